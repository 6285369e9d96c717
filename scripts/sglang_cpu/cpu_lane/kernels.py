"""Pure-torch versions of the ``sgl_kernel`` CPU ops that SGLang 0.5.23's EAGLE path calls.

Each function has the name and argument order of the CPU op it fills in (the ``if _is_cpu:`` branch
of the SGLang function named in its docstring) and the semantics of the Triton kernel that the
GPU branch launches. The six bookkeeping ops are vectorised index arithmetic. The two tree ops
run SGLang's own Triton kernels (its XPU path, ``sglang.kernels.ops.speculative.spec_tree``) under
Triton's interpreter, so the tree and the greedy tree verify are SGLang's code, not a re-telling.

``tests/test_sglang_lane.py`` (run inside the lane) checks the five index ops against SGLang's Triton
kernels for the same jobs, run by the interpreter on random inputs, and the KV-copy op's refusal.
"""

from __future__ import annotations

import torch


def _packed_ranges(start: torch.Tensor, end: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For ranges ``[start_i, end_i)`` packed back to back: (request index, column) of every element."""
    lengths = (end - start).long()
    req = torch.repeat_interleave(torch.arange(lengths.numel(), device=start.device), lengths)  # [total]
    offsets = torch.cumsum(lengths, 0) - lengths  # where request i's run begins in the packed order
    col = start.long()[req] + torch.arange(req.numel(), device=start.device) - offsets[req]
    return req, col


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len):
    """``srt.mem_cache.allocation.assign_req_to_token_pool_func``: req_to_token[r_i, start_i:end_i] = packed out_cache_loc."""
    req, col = _packed_ranges(start_offset, end_offset)
    req_to_token[req_pool_indices.long()[req], col] = out_cache_loc[:req.numel()].to(req_to_token.dtype)


def assign_extend_cache_locs_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len):
    """``kernels.ops.speculative.cache_locs`` (verify / front slots): packed out_cache_loc = req_to_token[r_i, start_i:end_i]."""
    req, col = _packed_ranges(start_offset, end_offset)
    out_cache_loc[:req.numel()] = req_to_token[req_pool_indices.long()[req], col].to(out_cache_loc.dtype)


def assign_draft_cache_locs_contiguous_cpu(req_pool_indices, req_to_token, seq_lens, out_cache_loc, pool_len, topk,
                                           num_cols):
    """``cache_locs.assign_draft_cache_locs_contiguous_func``: each request's ``topk * num_cols`` draft slots from seq_len on."""
    n = topk * num_cols
    cols = seq_lens.long()[:, None] + torch.arange(n, device=seq_lens.device)  # [bs, n]
    out_cache_loc[:cols.numel()] = req_to_token[req_pool_indices.long()[:, None], cols].flatten().to(out_cache_loc.dtype)


def fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, accept_out_cache_loc):
    """``kernels.ops.speculative.eagle.fill_accept_out_cache_loc_func``: slots of accepted tokens, -1 entries dropped."""
    flat = accept_index.flatten()
    kept = flat[flat != -1].long()
    accept_out_cache_loc[:kept.numel()] = out_cache_loc[kept]


def fill_bonus_tokens_cpu(accept_tokens, accept_lens, bonus_tokens, accept_stride):
    """``eagle.fill_bonus_tokens_func``: request i's last accepted token, at ``stride * i + accept_len_i - 1``."""
    rows = torch.arange(accept_lens.numel(), device=accept_lens.device)
    bonus_tokens[:rows.numel()] = accept_tokens.flatten()[accept_stride * rows + accept_lens.long() - 1]


def copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc):
    """``kernels.ops.kvcache.cache_move.copy_all_layer_kv_cache_func``: a raw-pointer copy of KV rows.

    With ``SGLANG_NATIVE_MOVE_KV_CACHE=1`` (set by the lane) SGLang moves tree KV by indexing and
    only the pool's start-up self-test reaches this op, with targets equal to sources; anything
    else would need pointer arithmetic, so it raises instead of copying nothing.
    """
    if tgt_loc.numel() and not bool((tgt_loc == src_loc).all()):
        raise RuntimeError("copy_all_layer_kv_cache_cpu: a real KV move reached the pointer-based copy; "
                           "the lane expects SGLANG_NATIVE_MOVE_KV_CACHE=1")


def _interpreted(kernel_name: str):
    """SGLang's Triton kernel ``spec_tree.<kernel_name>``, swapped (once) for Triton's interpreted version."""
    from triton.runtime.interpreter import InterpretedFunction

    from sglang.kernels.ops.speculative import spec_tree

    kernel = getattr(spec_tree, kernel_name)
    if not isinstance(kernel, InterpretedFunction):
        setattr(spec_tree, kernel_name, InterpretedFunction(kernel.fn))
    return spec_tree


def build_tree_kernel_efficient_cpu(parent_list, selected_index, verified_seq_len, tree_mask, positions,
                                    retrieve_index, retrieve_next_token, retrieve_next_sibling, topk, depth,
                                    draft_token_num, tree_mask_mode):
    """``spec_tree.build_tree_kernel_efficient_func``: the draft tree's mask, positions and retrieve links."""
    spec_tree = _interpreted("sgl_build_tree_kernel_efficient_triton")
    spec_tree.sgl_build_tree_kernel_triton(parent_list, selected_index, verified_seq_len, tree_mask, positions,
                                           retrieve_index, retrieve_next_token, retrieve_next_sibling, topk, depth,
                                           draft_token_num, tree_mask_mode)


def verify_tree_greedy_cpu(predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
                           retrive_next_sibling, target_predict):
    """``spec_tree.verify_tree_greedy_func``: walk each request's tree, keeping children equal to the target's argmax."""
    spec_tree = _interpreted("verify_tree_greedy_kernel_triton")
    spec_tree.verify_tree_greedy_triton(predicts, accept_index, accept_token_num, candidates, retrive_index,
                                        retrive_next_token, retrive_next_sibling, target_predict)


OPS = (assign_req_to_token_pool_cpu, assign_extend_cache_locs_cpu, assign_draft_cache_locs_contiguous_cpu,
       fill_accept_out_cache_loc_cpu, fill_bonus_tokens_cpu, copy_all_layer_kv_cache_cpu,
       build_tree_kernel_efficient_cpu, verify_tree_greedy_cpu)
