"""The reference forward of a vision-language output: each sample's images re-read and its inputs rebuilt.

For every sample of a batch, each stored image (``images`` column) is read again from its stored
source and its pixel hash compared with the stored one: a file by its path; an image that came from
a dataset column (``column images[k]``) from the run's dataset row, opened when first needed
(:class:`DatasetRows`: the dataset the metadata records, or the one given). A missing file or row, or
an image whose pixels changed, stops the recompute with one line naming the sample and the image. The image processor the model was saved with turns the images
into pixels; each image's grid and token count must be the stored ones, its stored token block must
hold the model's image token, and ``image_mask`` must be 1 exactly on those blocks.

The forward is the model's own: ``input_ids`` with the pixels (and ``image_grid_thw``), right-padded,
no position ids. On mRoPE models it is given the image-token types of the stored blocks, from which
the model computes its 3-D positions itself; the stored ``mrope_positions`` and ``rope_delta`` are
checked against the model's ``get_rope_index`` over the whole sequence (a ``positions`` finding).
On Gemma 3 it is given ``token_type_ids`` 1 on the stored image blocks (each block attends to itself
both ways). Boundary 0 is ``hidden_states[0]``, the merged text and vision embeddings. On deepstack models
(Qwen3-VL, Qwen3-VL-MoE) boundaries 1..L-1 are the blocks' inputs, after the deepstack add, as hsx stores them.
On models with recurrent layers (Qwen3.5's Gated DeltaNet) the right padding follows every real token, so the
batched forward is exact for them; the tolerance adds the recurrent allowance (the engine decoded those layers
token by token, this forward runs their chunked form), as for text targets.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hsx.align import ModelShape
from hsx.data.images import COLUMN_SOURCE, ImageColumn, VisionSpec, image_hash, read_image
from hsx.errors import HsxError, SampleError
from hsx.recompute.reference import Reference
from hsx.recompute.results import Finding


@dataclass
class VisionReference(Reference):
    """A :class:`Reference` whose batches carry each sample's re-read images."""

    spec: VisionSpec | None = None
    processor: Any = None  # the model's image processor (PIL backend)
    dataset_row: Callable[[int], Mapping] | None = None  # source index -> the run's input row (DatasetRows)

    @staticmethod
    def load(path: str, device: torch.device, dtype: torch.dtype, trust_remote_code: bool = False) -> VisionReference:
        from hsx.engine.hf.vision import load_vision_target

        try:
            model, _, processor, spec = load_vision_target(path, dtype, trust_remote_code)
        except (OSError, ValueError) as e:
            raise HsxError(f"cannot load vision-language model {path!r} for the recompute: {e}") from None
        return VisionReference.around(model.to(device).eval(), spec, processor)

    @staticmethod
    def around(model: torch.nn.Module, spec: VisionSpec, processor) -> VisionReference:
        """A reference around a vision-language model already in memory."""
        from hsx.engine.families import has_recurrent_layers
        from hsx.engine.hf.vision import language_model

        p = next(model.parameters())
        shape = ModelShape.from_config(model.config.get_text_config())
        # recurrent layers (Qwen3.5): the engine decodes them token by token, this forward runs their chunked form
        return VisionReference(model, shape, p.device, p.dtype, model.model, language_model(model).norm,
                               has_recurrent_layers(model), spec=spec, processor=processor)

    def sample_states(self, samples: Sequence, ids: Sequence[torch.Tensor], sources, sample_ids: list[str]
                      ) -> tuple[dict, dict[int, list[Finding]]]:
        lengths = torch.tensor([t.numel() for t in ids])
        width = int(lengths.max())
        batch = torch.zeros(len(ids), width, dtype=torch.long)
        types = torch.zeros(len(ids), width, dtype=torch.int32)  # 1 on the stored image blocks
        pixels, grids = [], []
        for i, (s, t) in enumerate(zip(samples, ids)):
            batch[i, : t.numel()] = t
            pv, grid = self._sample_pixels(s, sample_ids[i], t, types[i])
            if pv is not None:
                pixels.append(pv)
                grids.append(grid)
        mask = (torch.arange(width)[None, :] < lengths[:, None]).long()  # [B, T]
        self._check_ids(batch)
        inputs = {"input_ids": batch.to(self.device), "attention_mask": mask.to(self.device)}
        if pixels:
            inputs["pixel_values"] = torch.cat(pixels).to(self.device, self.dtype)
        findings: dict[int, list[Finding]] = {}
        if self.spec.mrope:
            grid = torch.cat(grids).to(self.device) if grids else None
            if grid is not None:
                inputs["image_grid_thw"] = grid
            inputs["mm_token_type_ids"] = types.to(self.device)
            findings = self._check_positions(samples, sample_ids, inputs, grid, lengths)
        if self.spec.bidirectional:  # Gemma 3: the stored image blocks attend both ways inside themselves
            inputs["token_type_ids"] = types.long().to(self.device)
        try:
            states = self._forward(sources, **inputs)
        finally:
            if self.spec.mrope:
                self.model.model.rope_deltas = None  # the model keeps the last batch's deltas between calls
        return states, findings

    def _forward(self, sources, **inputs) -> dict:
        """The states of ``sources``; on deepstack models boundaries 1..L-1 are what each block receives (after
        the vision features are added), taken by pre-hooks: transformers' ``hidden_states[b]`` is before the add."""
        if not self.spec.deepstack:
            return super()._forward(sources, **inputs)
        blocks = self.decoder.language_model.layers
        inner = [s for s in dict.fromkeys(sources) if isinstance(s, int) and 0 < s < self.shape.num_layers]
        received: dict = {}

        def keep(b):
            def hook(module, args):  # returns None: the block's input is left as it is
                received[b] = args[0]
            return hook

        handles = [blocks[b].register_forward_pre_hook(keep(b)) for b in inner]
        try:
            states = super()._forward(sources, **inputs)
        finally:
            for h in handles:
                h.remove()
        return {**states, **{b: received[b].float() for b in inner}}

    def chunks(self, input_ids, sources, size):
        raise HsxError("a vision-language output is recomputed one whole sample per forward (its images go in "
                       "whole): --recompute-chunk does not apply")

    def _sample_pixels(self, sample, sid: str, ids: torch.Tensor, types: torch.Tensor):
        """The sample's pixels and grid, rebuilt from its re-read images; ``types`` set to 1 on its image blocks."""
        cols = getattr(sample, "vision", None)
        if cols is None:
            raise HsxError(f"sample {sid!r}: no image columns; a vision-language output stores image_mask and images "
                           "for every sample")
        stored = list(cols["images"] or [])
        for im in stored:
            types[im["start"] : im["start"] + im["num_tokens"]] = 1
        n = ids.numel()
        mask = torch.as_tensor(cols["image_mask"]).reshape(-1).to(torch.int32)
        if mask.numel() != n or not torch.equal(mask, types[:n]):
            raise HsxError(f"sample {sid!r}: image_mask is not 1 exactly on its images' token blocks "
                           f"({int(mask.sum())} image tokens marked, the blocks hold {int(types[:n].sum())})")
        token = self.spec.image_token_id
        wrong = ((ids == token) != types[:n].bool()).nonzero()[:, 0]
        if wrong.numel():
            p = int(wrong[0])
            inside = bool(types[p])
            raise HsxError(f"sample {sid!r}: token {p} is {'not ' if inside else ''}the image token {token} "
                           f"{'inside' if inside else 'outside'} an image block; the model places image features "
                           "at every image token, so this sequence cannot be recomputed as stored")
        if not stored:
            return None, None
        images = [self._reread(sample, sid, k, im) for k, im in enumerate(stored)]
        pixel_values, grid, grid_list, counts = self.spec.pixels(self.processor, images)
        for k, (im, g, c) in enumerate(zip(stored, grid_list, counts)):
            if list(g) != list(im["grid"]) or c != im["num_tokens"]:
                raise HsxError(f"sample {sid!r} image {k} ({im['source']!r}): the model's image processor gives grid "
                               f"{list(g)} and {c} tokens, the run stored grid {list(im['grid'])} and "
                               f"{im['num_tokens']} tokens (another image processor?)")
        return pixel_values, grid

    def _reread(self, sample, sid: str, k: int, im: dict):
        source = im["source"]
        where = f"sample {sid!r} image {k}"
        column = COLUMN_SOURCE.fullmatch(source)
        try:
            if column is not None:
                image = self._from_dataset(sample, sid, where, column.group(1), int(column.group(2)))
            elif source == "inline":
                raise HsxError(f"{where}: it was given inline in the row, not as a file or a column; --recompute "
                               "cannot read it again")
            elif not Path(source).is_file():
                raise HsxError(f"{where}: {source!r} does not exist; --recompute re-reads each image from the path the "
                               "run read it from (relative paths from the working directory)")
            else:
                image = read_image(sid, where, source)
        except SampleError as e:
            raise HsxError(e.reason) from None
        found = image_hash(image)
        if found != im["sha256"]:
            raise HsxError(f"{where}: {source!r} has changed since the run (pixel sha256 {found[:16]}..., the run "
                           f"stored {im['sha256'][:16]}...); restore the image the run read")
        return image

    def _from_dataset(self, sample, sid: str, where: str, name: str, k: int):
        if self.dataset_row is None:
            raise HsxError(f"{where}: it came from the dataset's column {name!r}, and no dataset is open to read it "
                           "again from")
        index = getattr(sample, "source_index", None)
        if index is None:
            raise HsxError(f"{where}: it came from the dataset's column {name!r}, and the sample records no source "
                           "index to find its row by")
        return ImageColumn(sid, self.dataset_row(int(index))).get(name, k, where)

    def _check_positions(self, samples, sample_ids, inputs, grid, lengths) -> dict[int, list[Finding]]:
        """The stored mRoPE positions and rope_delta against the model's rope index over each whole sequence."""
        with torch.inference_mode():
            positions, deltas = self.model.model.get_rope_index(
                inputs["input_ids"], mm_token_type_ids=inputs["mm_token_type_ids"], image_grid_thw=grid,
                attention_mask=inputs["attention_mask"])
        positions, deltas = positions.cpu(), deltas.reshape(-1).cpu()
        out: dict[int, list[Finding]] = {}
        for i, s in enumerate(samples):
            n, cols, sid = int(lengths[i]), s.vision, sample_ids[i]
            want = positions[:, i, :n]  # [3, N]
            stored = cols["mrope_positions"]
            if stored is None or torch.as_tensor(stored).numel() != 3 * n:
                got = "none" if stored is None else f"{torch.as_tensor(stored).numel()} values"
                out[i] = [_positions_finding(sid, 0, n - 1, n, f"sample {sid!r}: mrope_positions holds {got}, "
                                                                f"expected 3 x {n} tokens")]
                continue
            bad = (torch.as_tensor(stored).reshape(3, n).long() != want).any(0).nonzero()[:, 0]
            found = []
            if bad.numel():
                a, b = int(bad[0]), int(bad[-1])
                found.append(_positions_finding(sid, a, b, bad.numel(), f"sample {sid!r}: tokens {a}..{b}: "
                                                f"{bad.numel()} stored mRoPE positions differ from the model's rope "
                                                "index over the sequence"))
            if cols["rope_delta"] != int(deltas[i]):
                found.append(_positions_finding(sid, 0, n - 1, 0, f"sample {sid!r}: rope_delta {cols['rope_delta']} "
                                                f"stored, the model's rope index gives {int(deltas[i])}"))
            if found:
                out[i] = found
        return out


def _positions_finding(sid: str, first: int, last: int, rows: int, message: str) -> Finding:
    return Finding(sid, "mrope_positions", "", first, last, rows, "positions", "", float("inf"), message)


class DatasetRows:
    """The run's input rows by source index, opened on the first call (an output whose images are all files
    never opens its dataset): the dataset and split the metadata records, or ``given``."""

    def __init__(self, recorded: Mapping | None, given: str | None = None):
        recorded = recorded or {}
        self.source = given or recorded.get("source")
        self.split = recorded.get("split") or "train"
        self.num_rows = None if given else recorded.get("num_rows")
        self._rows = None

    def __call__(self, index: int) -> Mapping:
        if self._rows is None:
            self._rows = self._open()
        if not 0 <= index < len(self._rows):
            raise HsxError(f"dataset {self.source!r}: no row {index} (it has {len(self._rows)}); the run read "
                           "another dataset")
        return self._rows[index]

    def _open(self):
        from hsx.data.load import load_rows

        if not self.source:
            raise HsxError("the output's images came from a dataset column, and its metadata names no dataset: "
                           "give --dataset")
        try:
            rows = load_rows(self.source, self.split)
        except (HsxError, OSError, ValueError) as e:
            raise HsxError(f"cannot open the run's dataset {self.source!r} (split {self.split!r}) to re-read the images "
                           f"of its columns ({e}); give --dataset where it is now") from None
        if self.num_rows is not None and len(rows) != int(self.num_rows):
            raise HsxError(f"dataset {self.source!r} has {len(rows)} rows; the run read {self.num_rows} (another "
                           "dataset, or it changed): give --dataset")
        return rows

