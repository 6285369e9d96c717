"""EAGLE3 training samples straight from a run (:class:`hsx.run.feed.Feed`), with no shards in between.

:class:`Eagle3Stream` yields the dicts :class:`~hsx.eagle3.dataset.Eagle3Dataset` gives for the
shards of ``hsx extract`` with the same config (same keys, shapes, dtypes and bits, in the same
source order), so ``DataLoader(stream, batch_size=B, collate_fn=collate)`` and
:func:`~hsx.eagle3.dataset.shift_for_draft` make the same batches as the offline path. With
``rank`` and ``world_size`` (by default from torchrun's environment) each rank gets its share of
the samples, as :class:`hsx.run.feed.Feed` shares records; a padding sample (``remainder="pad"``)
carries ``"padding": True`` and an all-zero ``loss_mask``, so a loss over masked positions is
unchanged by it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, Mapping

import torch

from hsx.align.layers import EAGLE3, FINAL
from hsx.config import ExtractConfig
from hsx.eagle3.dataset import check_eagle3_layout, eagle3_sample, load_draft_config
from hsx.errors import HsxError
from hsx.run.feed import DEFAULT_AHEAD, DEFAULT_RANK_TIMEOUT, Feed, Padding
from hsx.shards.writer import Record


class Eagle3Stream(torch.utils.data.IterableDataset):
    """EAGLE3 samples of the run ``config`` describes, as the engine produces them.

    A bad row or a sample the engine gave up on is skipped: it is in ``failures`` (and
    ``summary.errors``), as ``extract`` would record it. Each iteration is one pass over the
    dataset (the engine runs again). ``ahead``, ``ordered``, ``progress``, ``rank``, ``world_size``,
    ``remainder``, ``group`` and ``rank_timeout`` go to the feed.
    """

    def __init__(self, config: ExtractConfig | dict | str | Path, draft_config: str | Path | Mapping | None = None, *,
                 max_len: int | None = None, dtype: torch.dtype = torch.bfloat16, ahead: int = DEFAULT_AHEAD,
                 ordered: bool = True, progress: bool = False, rank: int | None = None, world_size: int | None = None,
                 remainder: str = "keep", group: str | None = None, rank_timeout: float = DEFAULT_RANK_TIMEOUT):
        if max_len is not None and max_len < 1:
            raise HsxError(f"max_len must be >= 1, got {max_len}")
        self.feed = Feed(config, ahead=ahead, ordered=ordered, progress=progress, rank=rank, world_size=world_size,
                         remainder=remainder, group=group, rank_timeout=rank_timeout)
        self.layout = check_eagle3_layout(self.feed.metadata, load_draft_config(draft_config), "the stream's run")
        self.max_len, self.dtype = max_len, dtype

    @property
    def metadata(self) -> dict:
        return self.feed.metadata

    @property
    def summary(self):
        return self.feed.summary

    @property
    def failures(self):
        return self.feed.failures

    def __iter__(self) -> Iterator[dict]:
        for item in self.feed:
            if isinstance(item, Record):
                sample = eagle3_sample(self.layout, item.sample_id, item.input_ids, item.loss_mask, item.hidden[EAGLE3],
                                       item.hidden[FINAL], max_len=self.max_len, dtype=self.dtype)
                if isinstance(item, Padding):
                    sample["loss_mask"] = torch.zeros_like(sample["loss_mask"])
                    sample["padding"] = True
                yield sample
