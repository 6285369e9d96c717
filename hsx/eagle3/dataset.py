"""EAGLE3 training samples from hsx shards, in the form SpecForge's offline files hold them.

One sample (``Eagle3Dataset[i]``), T tokens:

    input_ids         [T] int64         token t
    loss_mask         [T] int64         1 where token t is learned (assistant / completion tokens)
    aux_hidden_state  [T, 3H] bfloat16  the ``eagle3`` column: three boundaries, low to high,
                                        after consuming token t
    hidden_state      [T, H] bfloat16   the ``final`` column (final-norm output) after token t
    sample_id         str               the shard's sample id

Nothing is shifted here: row t of both states is the state after consuming token t, which is
both hsx's convention (docs/FORMAT.md) and what SpecForge's ``prepare_hidden_states.py``
stores (one prefill forward, states kept position by position).

Where the shift happens. SpecForge 0.2.0 makes it in two places, reproduced here:

1. per sample, ``normalize_offline_sample`` (specforge/algorithms/eagle3/data.py) truncates
   to ``max_len`` and sets the LAST loss_mask entry to 0; :func:`collate` does the same, then
   right-pads like ``DataCollatorWithPadding`` (specforge/data/utils.py);
2. per batch, ``TargetHead.preprocess`` (specforge/modeling/target/target_head.py, called from
   ``_prepare_eagle_target`` in specforge/training/strategies/base.py) shifts ``input_ids``
   and the final ``hidden_state`` left by one with a zero fill (``specforge.utils.padding(x,
   left=False)``), and leaves ``aux_hidden_state`` and ``loss_mask`` where they are;
   :func:`shift_for_draft` does that.

So at position t of a training batch the draft sees the aux state after token t and the
embedding of token t+1, and is taught the target's distribution computed from the final
state after token t+1, i.e. the distribution of token t+2; the position counts when
``loss_mask[t]`` is 1 (token t is learned) and never at a sample's last position, whose shifted
inputs are padding.

Generate-mode shards hold N-1 rows for N tokens (the last completion token was never fed
back). Such samples come out with T = N-1 tokens: the last token is dropped. Nothing trainable
is lost: after the shift the last position of a sample is masked anyway, so a T = N sample
would need row N-1 only as the target of position N-2, and that row does not exist. The
distribution that produced the dropped token (row N-2) is still the target at position N-3.
Prefill-mode shards hold N rows and come out with T = N, exactly as SpecForge prepares them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from hsx.align.layers import EAGLE3, FINAL, eagle3_boundaries_from_ids
from hsx.heads.layer_ids import HF_READING, head_marker, resolve_head_layers
from hsx.errors import AlignmentError, HsxError
from hsx.shards.reader import ShardDataset, open_shards


@dataclass(frozen=True)
class Eagle3Layout:
    """What a set of shards offers EAGLE3 training, checked once from its metadata."""

    mode: str  # generate | prefill
    hidden_size: int  # width of the `final` column (lm_head's input)
    aux_boundaries: tuple[int, int, int]
    num_layers: int
    stored_dtype: str
    hc_mult: int = 1  # hyper-connection streams: a boundary is hc_mult x hidden_size wide

    @property
    def aux_width(self) -> int:
        return 3 * self.hidden_size * self.hc_mult


def load_draft_config(config: str | Path | Mapping[str, Any] | None) -> dict | None:
    """A draft config as a dict: a mapping, a ``config.json`` file, or a directory holding one."""
    if config is None or isinstance(config, Mapping):
        return None if config is None else dict(config)
    path = Path(config)
    if path.is_dir():
        path = path / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise HsxError(f"draft config {path}: no such file") from None
    except json.JSONDecodeError as e:
        raise HsxError(f"draft config {path}: not valid JSON ({e})") from None


def _draft_aux_boundaries(draft: dict, num_layers: int, model_type: str | None) -> tuple[tuple[int, ...], str]:
    if head_marker(draft) is not None:  # the head says which rule its ids follow (hsx export vllm-head, the demo trainer)
        layers = resolve_head_layers(draft, HF_READING, model_type, num_layers)
        if layers.boundaries is None or len(layers.boundaries) != 3:
            raise HsxError(f"draft config: EAGLE3 needs 3 aux layer ids, found {layers.head_ids}")
        return layers.boundaries, layers.note()
    ids = (draft.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    where = "eagle_config.eagle_aux_hidden_state_layer_ids"
    if ids is None:
        # SpecForge's fallback when the draft config names no layers (resolve_eagle_capture_layers).
        ids = [1, num_layers // 2 - 1, num_layers - 4]
        where = "SpecForge's default ids [1, L//2-1, L-4]"
    boundaries, rule = eagle3_boundaries_from_ids(ids, num_layers)
    return boundaries, f"{where} {list(ids)} -> boundaries {list(boundaries)} ({rule})"


def check_eagle3_layout(metadata: dict, draft_config: Mapping[str, Any] | None = None, where: str = "shards") -> Eagle3Layout:
    """Refuse shards EAGLE3 training cannot use; with a draft config, also its widths and layers."""
    groups = {g["name"]: g for g in metadata.get("layers", [])}
    missing = [name for name in (FINAL, EAGLE3) if name not in groups]
    if missing:
        raise HsxError(
            f"{where}: EAGLE3 training needs hidden-state columns 'final' (final-norm output) and 'eagle3' "
            f"(three aux boundaries); missing {missing}, found {sorted(groups)}. Extract with --layers final,eagle3"
        )
    final, aux = groups[FINAL], groups[EAGLE3]
    sources = tuple(aux["sources"])
    if len(sources) != 3 or not all(isinstance(b, int) for b in sources):
        raise HsxError(f"{where}: column 'eagle3' must hold three boundaries, found sources {list(sources)}")
    if list(final["sources"]) != [FINAL]:
        raise HsxError(f"{where}: column 'final' must hold the final-norm output, found sources {final['sources']}")
    h = int(final["width"])
    model = metadata.get("model") or {}
    hc = int(model.get("hc_mult") or 1)  # a boundary is all the streams, final one of them
    if int(aux["width"]) != 3 * h * hc:
        times = "3" if hc == 1 else f"3 x {hc} (hyper-connection streams)"
        raise HsxError(f"{where}: 'eagle3' width {aux['width']} is not {times} x the 'final' width {h}")
    keep = metadata.get("keep", "all")
    if keep != "all":
        raise HsxError(f"{where}: EAGLE3 training needs a row for every position; these shards keep only "
                       f"{keep!r} positions (extract with --keep all)")
    num_layers = int(model.get("num_layers") or 0)
    layout = Eagle3Layout(metadata.get("mode", "?"), h, sources, num_layers, metadata.get("dtype", "?"), hc)
    if layout.mode not in ("generate", "prefill"):
        raise HsxError(f"{where}: unknown mode {layout.mode!r}; expected generate or prefill")
    if draft_config is None:
        return layout
    target_h = draft_config.get("target_hidden_size") or draft_config.get("hidden_size")
    key = "target_hidden_size" if draft_config.get("target_hidden_size") else "hidden_size"
    if target_h is None:
        raise HsxError("draft config has neither target_hidden_size nor hidden_size")
    if int(target_h) != h:
        raise HsxError(
            f"{where}: draft config {key}={target_h} expects 'final' width {target_h} and 'eagle3' width "
            f"{3 * hc * int(target_h)}; the shards have {h} and {aux['width']}"
        )
    if not num_layers:
        raise HsxError(f"{where}: metadata model.num_layers is missing; cannot check the draft's aux layers")
    expected, how = _draft_aux_boundaries(draft_config, num_layers, model.get("model_type"))
    if tuple(expected) != sources:
        raise HsxError(
            f"{where}: draft config {how} for a {num_layers}-block model, but the shards' 'eagle3' column holds "
            f"boundaries {list(sources)} ({aux.get('rule')}). Re-extract with --eagle3-layer-ids matching the draft"
        )
    return layout


class Eagle3Dataset(torch.utils.data.Dataset):
    """EAGLE3 samples (see the module docstring) over a shard directory, file or open ShardDataset.

    States are zero-copy read-only views of the shards when they are stored in ``dtype``
    (bfloat16 by default, hsx's default too); other stored dtypes are converted (a copy).
    ``max_len`` truncates every sample to its first ``max_len`` tokens, like SpecForge's loader.
    """

    def __init__(self, shards: str | Path | ShardDataset, draft_config: str | Path | Mapping | None = None, *,
                 max_len: int | None = None, dtype: torch.dtype = torch.bfloat16):
        self.shards = shards if isinstance(shards, ShardDataset) else open_shards(shards)
        where = str(shards) if not isinstance(shards, ShardDataset) else "shards"
        self.layout = check_eagle3_layout(self.shards.metadata, load_draft_config(draft_config), where)
        if max_len is not None and max_len < 1:
            raise HsxError(f"max_len must be >= 1, got {max_len}")
        self.max_len = max_len
        self.dtype = dtype

    def __len__(self) -> int:
        return len(self.shards)

    def num_tokens(self, n_tokens: int) -> int:
        """Tokens exported for a sample of ``n_tokens`` stored tokens (generate mode drops the last)."""
        return num_tokens(self.layout, n_tokens, self.max_len)

    def __getitem__(self, i: int) -> dict:
        s = self.shards[i]
        return eagle3_sample(self.layout, s.sample_id, s.input_ids, s.loss_mask, s.hidden(EAGLE3), s.hidden(FINAL),
                             max_len=self.max_len, dtype=self.dtype)


def num_tokens(layout: Eagle3Layout, n_tokens: int, max_len: int | None = None) -> int:
    """Tokens of the EAGLE3 sample of ``n_tokens`` stored tokens (generate mode drops the last)."""
    t = n_tokens - 1 if layout.mode == "generate" else n_tokens
    return t if max_len is None else min(t, max_len)


def eagle3_sample(layout: Eagle3Layout, sample_id: str, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                  aux: torch.Tensor, final: torch.Tensor, *, max_len: int | None = None,
                  dtype: torch.dtype = torch.bfloat16) -> dict:
    """One EAGLE3 sample (see the module docstring) from a sample's tokens and its two columns."""
    n = len(input_ids)
    rows = n - 1 if layout.mode == "generate" else n
    if aux.shape[0] != rows or final.shape[0] != rows:
        raise AlignmentError(
            f"sample {sample_id!r}: {n} tokens in {layout.mode} mode need {rows} rows; "
            f"'eagle3' has {aux.shape[0]}, 'final' has {final.shape[0]}"
        )
    t = num_tokens(layout, n, max_len)
    aux, final = aux[:t], final[:t]  # [T, 3H], [T, H]
    if aux.dtype != dtype:
        aux, final = aux.to(dtype), final.to(dtype)
    return {
        "input_ids": input_ids[:t].to(torch.int64),
        "loss_mask": loss_mask[:t].to(torch.int64),
        "aux_hidden_state": aux,
        "hidden_state": final,
        "sample_id": sample_id,
    }


def collate(samples: Sequence[dict], pad_token_id: int = 0) -> dict:
    """Right-pad samples into a batch, with SpecForge's per-sample loss-mask rule.

    Returns ``input_ids``, ``loss_mask``, ``attention_mask`` ``[B, T]`` int64, ``aux_hidden_state``
    ``[B, T, 3H]``, ``hidden_state`` ``[B, T, H]``, ``lengths`` ``[B]`` and ``sample_ids``. Each
    sample's last loss_mask entry is 0 (its shifted inputs are padding); padding is 0 everywhere
    (``pad_token_id`` for ids) with ``attention_mask`` 0. Nothing is shifted: see
    :func:`shift_for_draft`.
    """
    if not samples:
        raise HsxError("collate needs at least one sample")
    lengths = torch.tensor([len(s["input_ids"]) for s in samples], dtype=torch.int64)
    b, t = len(samples), int(lengths.max())
    aux0, fin0 = samples[0]["aux_hidden_state"], samples[0]["hidden_state"]
    input_ids = torch.full((b, t), pad_token_id, dtype=torch.int64)
    loss_mask = torch.zeros((b, t), dtype=torch.int64)
    attention_mask = torch.zeros((b, t), dtype=torch.int64)
    aux = torch.zeros((b, t, aux0.shape[-1]), dtype=aux0.dtype)  # [B, T, 3H]
    final = torch.zeros((b, t, fin0.shape[-1]), dtype=fin0.dtype)  # [B, T, H]
    for k, s in enumerate(samples):
        n = int(lengths[k])
        input_ids[k, :n] = s["input_ids"]
        loss_mask[k, :n] = s["loss_mask"]
        if n:
            loss_mask[k, n - 1] = 0
        attention_mask[k, :n] = 1
        aux[k, :n] = s["aux_hidden_state"]
        final[k, :n] = s["hidden_state"]
    return {"input_ids": input_ids, "loss_mask": loss_mask, "attention_mask": attention_mask,
            "aux_hidden_state": aux, "hidden_state": final, "lengths": lengths,
            "sample_ids": [s.get("sample_id") for s in samples]}


def shift_for_draft(batch: dict) -> dict:
    """The EAGLE3 training view of a :func:`collate` batch: the one left shift.

    Position t: ``input_ids`` = token t+1, ``aux_hidden_state`` = aux state after token t
    (unchanged), ``target_hidden_state`` = final state after token t+1 (its lm_head logits are
    the target's distribution of token t+2), ``loss_mask``/``attention_mask`` unchanged. The
    last column is zero-filled, as SpecForge's ``padding(x, left=False)`` does.
    """
    ids, final = batch["input_ids"], batch["hidden_state"]
    next_ids = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)  # [B, T]
    target = torch.cat([final[:, 1:], torch.zeros_like(final[:, :1])], dim=1)  # [B, T, H]
    return {"input_ids": next_ids, "aux_hidden_state": batch["aux_hidden_state"], "target_hidden_state": target,
            "loss_mask": batch["loss_mask"], "attention_mask": batch["attention_mask"]}
