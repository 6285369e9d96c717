"""Compressed attention in the engine's batched cache (DeepSeek-V4): transformers' compressors, one state per row.

A compressed-sparse or heavily-compressed attention layer attends over two sets of keys: the
sliding window of its own keys (one per token: :class:`~hsx.engine.hf.slots.SlotLayer` slots,
the window applied by the engine's mask), and compressed entries, one per closed window of
``compress_rate`` tokens, made by the layer's compressor module and kept, with the tokens of the
window still open, in transformers' own cache layer for the kind (``DeepseekV4HCACache`` /
``DeepseekV4CSACache``). That cache layer is batch-wide: one count of entries, one open window,
so every row would have to sit at the same position. The engine gives each row its own
transformers cache layer, and for the duration of its cached forwards has the compressor module
run once per row, over that row's tokens, at that row's positions (:meth:`CompressedCache.driving`);
the entries come back padded to the batch's longest, the padding hidden by the mask.

A compressed entry cannot be taken back out of a closed window, so a row's state is rolled back
by snapshot and replay: before a forward whose tokens may be kept only in part the row's cache
layer is snapshotted (its tensors are replaced, never written in place, so a snapshot is a copy
of its dicts) and the compressor's inputs are kept; at the commit, a row that keeps fewer tokens
than it was fed goes back to its snapshot and the compressor runs again over the kept ones
(:meth:`CompressedLayer.keep`). Rows that keep every token pay nothing.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from hsx.engine.hf.slots import SlotLayer


class _RowCache:
    """What a compressor reads of the cache it is handed: ``cache.layers[layer_idx]``, here one row's layer."""

    def __init__(self, layer_idx: int, layer):
        self.layers = {layer_idx: layer}


class CompressedLayer(SlotLayer):
    """One compressed attention layer: its keys in slots, and a transformers cache layer per row for the
    compressor's open window and entries."""

    def __init__(self, layer_idx: int, make_row, capacity: int = 0):
        SlotLayer.__init__(self, capacity)
        self.layer_idx = layer_idx
        self.make_row = make_row  # () -> transformers' cache layer of the kind, for one row
        self.rows: list = []
        self.recording = False
        self.snapshots: list = []  # per row, its layer's state before the forwards since the last keep
        self.fed: list = []  # per forward since the last keep: (hidden_states, q_residual, position_ids) [B, q, ...]
        self.replay = None  # the compressor's own forward, set while driving

    def record(self) -> None:
        """Keep what is needed to roll each row back to its state now, until the next :meth:`keep`."""
        if not self.recording:
            self.recording = True
            self.snapshots = [_snapshot(row) for row in self.rows]

    def compress(self, run, hidden_states, q_residual, position_ids, cache, layer_idx):
        """The compressor ``run`` over each row's tokens with that row's cache layer: ``([B, 1, T, d]`` entries,
        ``[B, 1, q, T]`` additive mask over them), T the most entries of any row."""
        batch, q = hidden_states.shape[:2]
        while len(self.rows) < batch:
            self.rows.append(self.make_row())
        if self.recording:
            while len(self.snapshots) < batch:
                self.snapshots.append(None)  # a row created during the recording: back to a fresh layer
            self.fed.append((hidden_states, q_residual, position_ids))
        outs = [run(hidden_states[b:b + 1], q_residual[b:b + 1], position_ids[b:b + 1],
                    _RowCache(layer_idx, self.rows[b]), layer_idx) for b in range(batch)]
        most = max(kv.shape[2] for kv, _ in outs)
        first = outs[0][0]
        entries = first.new_zeros(batch, 1, most, first.shape[3])  # [B, 1, T, d]
        bias = first.new_full((batch, 1, q, most), float("-inf"))  # [B, 1, q, T]: padding entries unseen
        for b, (kv, row_bias) in enumerate(outs):
            t = kv.shape[2]
            entries[b, :, :t] = kv[0]
            # no mask from the compressor: every query of the row sees every entry (one query, or none yet)
            bias[b, :, :, :t] = 0.0 if row_bias is None else row_bias[0]
        return entries, bias

    def keep(self, counts: torch.Tensor, n: int) -> None:
        """Row b keeps the first ``counts[b]`` of the ``n`` tokens fed since the last keep."""
        if not self.recording:
            if bool((counts != n).any()):
                raise RuntimeError(f"a compressed attention layer saw {n} tokens unrecorded and cannot drop "
                                   f"{n - int(counts.min())}")
            return
        run = self.replay
        for b, kept in enumerate(counts.tolist()):
            if kept == n:
                continue
            self.rows[b] = self.make_row() if self.snapshots[b] is None else _restored(self.make_row(), self.snapshots[b])
            if kept:
                hidden, q_res, pos = (torch.cat([f[k][b:b + 1] for f in self.fed], 1)[:, :kept] for k in range(3))
                run(hidden, q_res, pos, _RowCache(self.layer_idx, self.rows[b]), self.layer_idx)
        self.recording, self.snapshots, self.fed = False, [], []

    def select_rows(self, rows: torch.Tensor) -> None:
        self.rows = [self.rows[i] for i in rows.tolist()]

    def put_rows(self, rows: torch.Tensor, other: "CompressedLayer", src: torch.Tensor) -> None:
        for r, s in zip(rows.tolist(), src.tolist()):
            self.rows[r] = _restored(self.make_row(), _snapshot(other.rows[s]))

    def extend_rows(self, other: "CompressedLayer", src: torch.Tensor) -> None:
        self.rows += [_restored(self.make_row(), _snapshot(other.rows[s])) for s in src.tolist()]


def _snapshot(row) -> dict:
    """A row layer's state: its dicts of tensors and counts (transformers replaces their values, never edits them)."""
    return {name: dict(value) for name, value in vars(row).items() if isinstance(value, dict)}


def _restored(row, snapshot: dict):
    for name, value in snapshot.items():
        setattr(row, name, dict(value))
    return row


def find_compressors(blocks: torch.nn.ModuleList, layer_ids) -> dict[int, torch.nn.Module]:
    """Block i's compressor module (the one named ``...compressor`` directly; DeepSeek-V4's
    ``self_attn.compressor``), for each i of ``layer_ids``; a missing or ambiguous one raises."""
    found = {}
    for i in layer_ids:
        names = [n for n, _ in blocks[i].named_modules()
                 if n.split(".")[-1] == "compressor" and n.split(".").count("compressor") == 1]
        if len(names) != 1:
            raise RuntimeError(f"block {i}: expected one compressor module, found {names or 'none'}")
        found[i] = blocks[i].get_submodule(names[0])
    return found


@contextmanager
def driving(layers: list[CompressedLayer], compressors: dict[int, torch.nn.Module]):
    """Inside ``with``, each compressor module runs per row through its layer (:meth:`CompressedLayer.compress`)."""
    patched = []
    try:
        for layer in layers:
            module = compressors[layer.layer_idx]
            run = module.forward  # the class's forward, bound
            layer.replay = run
            module.forward = lambda *args, _layer=layer, _run=run, **kw: _layer.compress(_run, *args, **kw)
            patched.append(module)
        yield
    finally:
        for module in patched:
            del module.forward  # the class's forward again
