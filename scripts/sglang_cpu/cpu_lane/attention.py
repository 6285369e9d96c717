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
  The decode itself is the stock torch_native one.
"""

from __future__ import annotations

import torch
from torch.nn.functional import scaled_dot_product_attention

from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc


class SpecTorchNativeBackend(TorchNativeAttnBackend):
    """``TorchNativeAttnBackend`` plus the tree-masked TARGET_VERIFY forward."""

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        if not forward_batch.forward_mode.is_target_verify():
            return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
        if save_kv_cache and k is not None and v is not None:
            self.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc(forward_batch.out_cache_loc, self.swa_out_cache_loc),
                                                k, v)
        return self._verify(q, layer, forward_batch)

    def _verify(self, q, layer, fb):
        spec = fb.spec_info
        n = spec.draft_token_num
        heads, dim = layer.tp_q_head_num, layer.qk_head_dim
        q_ = q.reshape(-1, heads, dim)  # [bs * n, heads, dim]
        out = q.new_empty((q_.shape[0], heads, layer.v_head_dim))
        keys = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        values = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
        tree = spec.custom_mask.view(fb.batch_size, n, n)  # [bs, query draft, key draft], True = visible
        r2t = self.req_to_token_pool.req_to_token
        for i in range(fb.batch_size):
            prefix = int(fb.seq_lens[i])
            slots = r2t[fb.req_pool_indices[i], :prefix + n].long()  # committed prefix, then the n drafts
            visible = torch.cat([tree.new_ones((n, prefix)), tree[i]], dim=1)  # [n, prefix + n]
            qi = q_[i * n:(i + 1) * n].movedim(0, 1)  # [heads, n, dim]
            ki, vi = (c[slots].movedim(0, 1).to(qi.dtype) for c in (keys, values))  # [kv_heads, prefix + n, dim]
            oi = scaled_dot_product_attention(qi[None], ki[None], vi[None], attn_mask=visible, scale=layer.scaling,
                                              enable_gqa=heads != layer.tp_k_head_num)
            out[i * n:(i + 1) * n] = oi[0].movedim(1, 0)
        return out.view(-1, heads * layer.v_head_dim)


class _DraftStepBackend(SpecTorchNativeBackend):
    """Step ``step`` of the draft loop: stock torch_native decode over the expanded per-branch table."""

    def __init__(self, model_runner, step: int):
        super().__init__(model_runner)
        self.step = step
        self.branch_table = None  # (req_to_token rows, their pool indices, key counts), set per draft

    def _run_sdpa_forward_decode(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                                 *args, **kwargs):
        table, rows, lengths = self.branch_table
        return super()._run_sdpa_forward_decode(query, output, k_cache, v_cache, table, rows, lengths, *args,
                                                **kwargs)


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
        table = self.branch_rows(forward_batch.req_pool_indices, forward_batch.seq_lens)
        rows = torch.arange(table.shape[0], device=table.device)
        base = forward_batch.seq_lens.long().repeat_interleave(self.topk)
        for backend in self.attn_backends:
            backend.init_forward_metadata(forward_batch)
            backend.branch_table = (table, rows, base + backend.step + 1)


def create_torch_native_backend(runner):
    return SpecTorchNativeBackend(runner)
