"""The two attention forwards SGLang 0.5.23's ``torch_native`` backend lacks for EAGLE, as subclasses.

- :class:`SpecTorchNativeBackend` replaces ``TorchNativeAttnBackend`` for the target and the draft
  extend (registered under the same name, ``torch_native``). It adds the TARGET_VERIFY forward: each
  request's ``n`` draft tokens see the whole committed prefix plus the draft tokens the tree mask
  allows (``spec_info.custom_mask``, the ``n x n`` QLEN_ONLY layout SGLang builds on CPU). The stock
  backend would run that forward as a causal extend, which is right for a chain and silently wrong
  for a tree.
- :class:`TorchNativeMultiStepDraftBackend`: the per-step container the EAGLE draft loop needs
  (``DraftBackendFactory`` has no ``torch_native`` entry and refuses with "EAGLE is not supported in
  decode attention backend torch_native"). Like SGLang's Intel AMX version, it gives each of the
  ``topk`` branches of a request its own row of an expanded ``req_to_token`` table: the request's
  prefix followed by the branch's draft slots (branch t, step s at ``seq_len + t * num_steps + s``,
  the layout of ``per_step_draft_out_cache_loc``), so step s attends to ``seq_len + s + 1`` keys.

Both run one SDPA per layer over the batch padded to its longest row, with a boolean visibility
mask (the stock backend loops over requests in Python).
"""

from __future__ import annotations

import torch
from torch.nn.functional import scaled_dot_product_attention

from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc


def _attend(backend, q, layer, slots: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """One SDPA over a padded batch: query group g sees keys ``slots[g]`` where ``visible[g]`` is True.

    q: [G * n, heads * dim]; slots: [G, K] KV-pool rows; visible: [G, n, K] -> out [G * n, heads * v_dim].
    """
    heads, groups, n = layer.tp_q_head_num, slots.shape[0], visible.shape[1]
    keys = backend.token_to_kv_pool.get_key_buffer(layer.layer_id)[slots]  # [G, K, kv_heads, dim]
    values = backend.token_to_kv_pool.get_value_buffer(layer.layer_id)[slots]
    qg = q.reshape(groups, n, heads, layer.qk_head_dim).transpose(1, 2)  # [G, heads, n, dim]
    out = scaled_dot_product_attention(qg, keys.transpose(1, 2).to(qg.dtype), values.transpose(1, 2).to(qg.dtype),
                                       attn_mask=visible[:, None], scale=layer.scaling,
                                       enable_gqa=heads != layer.tp_k_head_num)  # [G, heads, n, v_dim]
    return out.transpose(1, 2).reshape(groups * n, heads * layer.v_head_dim)


class SpecTorchNativeBackend(TorchNativeAttnBackend):
    """``TorchNativeAttnBackend`` plus the tree-masked TARGET_VERIFY forward."""

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        if not forward_batch.forward_mode.is_target_verify():
            return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
        if save_kv_cache and k is not None and v is not None:
            self.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc(forward_batch.out_cache_loc, self.swa_out_cache_loc),
                                                k, v)
        slots, visible = self._verify_layout(forward_batch)
        return _attend(self, q, layer, slots, visible)

    def _verify_layout(self, fb) -> tuple[torch.Tensor, torch.Tensor]:
        """Per request: its committed prefix (all visible) then its n drafts (visible per the tree mask)."""
        n = fb.spec_info.draft_token_num
        prefix = fb.seq_lens.long()  # [bs], without the drafts
        tree = fb.spec_info.custom_mask[:fb.batch_size * n * n].view(fb.batch_size, n, n)  # [bs, query, key draft]; True = visible
        cols = torch.arange(int(prefix.max()) + n, device=prefix.device)
        rel = cols[None, :] - prefix[:, None]  # [bs, K]: < 0 prefix, 0..n-1 drafts, >= n padding
        in_tree = (rel >= 0) & (rel < n)
        drafts = tree.gather(2, rel.clamp(0, n - 1)[:, None, :].expand(-1, n, -1))  # [bs, n, K]
        visible = (rel < 0)[:, None, :] | (drafts & in_tree[:, None, :])
        rows = self.req_to_token_pool.req_to_token[fb.req_pool_indices.long()[:, None], cols[None, :]]
        return rows.long().masked_fill(~(rel < n), 0), visible


class _DraftStepBackend(SpecTorchNativeBackend):
    """Step ``step`` of the draft loop: each branch attends to its row of the expanded per-branch table."""

    def __init__(self, model_runner, step: int):
        super().__init__(model_runner)
        self.step = step
        self.branch_table = None  # (slots [rows, K], visible [rows, 1, K]), set per draft

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        if save_kv_cache and k is not None and v is not None:
            self.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc(forward_batch.out_cache_loc, self.swa_out_cache_loc),
                                                k, v)
        slots, visible = self.branch_table
        return _attend(self, q, layer, slots, visible)


class TorchNativeMultiStepDraftBackend:
    """One :class:`_DraftStepBackend` per draft step that attends (``num_steps - 1``; the last only samples)."""

    def __init__(self, model_runner, topk: int, speculative_num_steps: int):
        self.topk = topk
        self.speculative_num_steps = speculative_num_steps
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.attn_backends = [_DraftStepBackend(model_runner, s) for s in range(speculative_num_steps - 1)]

    def branch_rows(self, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """``[bs * topk, max(seq_len) + num_steps]`` slots: row (i, t) = prefix of i, then branch t's draft slots."""
        steps, topk = self.speculative_num_steps, self.topk
        lens = seq_lens.long().repeat_interleave(topk)[:, None]  # [bs * topk, 1]
        branch = torch.arange(topk, device=lens.device).repeat(seq_lens.numel())[:, None]
        cols = torch.arange(int(seq_lens.max()) + steps, device=lens.device)[None, :]
        source = torch.where(cols < lens, cols, cols + branch * steps)  # draft column s -> seq_len + t*steps + s
        source = source.clamp(max=self.req_to_token.shape[1] - 1)  # columns past a row's keys are never read
        pool_rows = req_pool_indices.long().repeat_interleave(topk)[:, None]
        return self.req_to_token[pool_rows, source]

    def init_forward_metadata(self, forward_batch):
        table = self.branch_rows(forward_batch.req_pool_indices, forward_batch.seq_lens).long()  # [rows, K]
        lengths = forward_batch.seq_lens.long().repeat_interleave(self.topk)  # prefix keys of each branch
        cols = torch.arange(table.shape[1], device=table.device)[None, :]
        for backend in self.attn_backends:
            backend.init_forward_metadata(forward_batch)
            visible = cols < (lengths + backend.step + 1)[:, None]  # prefix + this branch's drafts 0..step
            backend.branch_table = (table.masked_fill(~visible, 0), visible[:, None, :])


def create_torch_native_backend(runner):
    return SpecTorchNativeBackend(runner)
