"""Speculative decoding on vision-language targets: chains drafted by a draft model or an EAGLE3 head.

The draft side is the text engine's own (:class:`hsx.engine.hf.drafting.Drafting` over a
:class:`hsx.engine.hf.kv.KV`): the draft runs at 1-D positions (its token count), whatever the
target's positions are. The target side is :class:`hsx.engine.hf.vision.VisionEngine`'s batch: one
``DynamicCache`` over right-padded rows and a 2-D attention mask that says which slots hold each
row's tokens. A verify step is one target forward over ``[root + drafts]`` per row, at positions
``prompt_len + t + rope_delta`` (t the token's index in the completion; all three axes on mRoPE
models). Acceptance is the text engine's: the longest prefix of drafts equal to the target's own
choice at their parent (argmax when greedy, one seeded sample per position otherwise), plus the
target's token after it. A row's rejected slots are masked out of every later step, and the slots
dead in every row are cropped off the cache's end: the one place the cache is cut. On a target with
sliding-window layers (Gemma 3) the cache keeps every slot and each verify step gets a 4-D mask per
layer type: the row's live slots, the chain's earlier tokens, and the window counted in positions.

What the draft sees at image tokens (``IMAGE_TOKEN_DRAFT_INPUT``): the placeholder token ids. A draft
model embeds them with its own embedding; an EAGLE3 head pairs the target's token embedding of the
placeholder id with the target's aux states there (which do carry the image). That is SGLang's
convention; vLLM feeds its EAGLE drafts the merged vision embeddings at those positions instead.

Chains only (``topk`` 1): a tree's branches would need a per-node mask this batch does not build.
"""

from __future__ import annotations

import torch

from hsx.align import Collector
from hsx.engine.families import FULL, AttentionPlan, window_plan
from hsx.engine.hf.batch_state import BatchState
from hsx.engine.hf.capture import Driven
from hsx.engine.hf.drafting import Drafting
from hsx.engine.hf.engine import SamplingSettings, SpecSettings, _choose, head_aux_boundaries
from hsx.engine.hf.kv import KV
from hsx.engine.hf.prompt_batch import prompt_block, prompt_positions
from hsx.errors import HsxError
from hsx.heads.load import Eagle3Head

IMAGE_TOKEN_DRAFT_INPUT = ("placeholder token embeddings: at image tokens a draft is fed the image placeholder id "
                           "(a draft model embeds it with its own embedding, an EAGLE3 head with the target's token "
                           "embedding beside the target's aux states), not the vision features (SGLang's convention)")


def verify_positions(root: torch.Tensor, depth: torch.Tensor, mrope: bool) -> torch.Tensor:
    """Positions of a verify step's tokens: ``root [B]`` the root's (``prompt_len + t + rope_delta``), ``depth [B, n]``;
    ``[3, B, n]`` (the same on all three axes) on mRoPE models, else ``[B, n]``."""
    pos = root[:, None] + depth
    return pos[None].expand(3, -1, -1) if mrope else pos


class VisionDrafts(Drafting):
    """A draft model or EAGLE3 head drafting chains for a vision-language target (see the module docstring)."""

    def __init__(self, draft_model, target, spec: SpecSettings | None, model_type: str):
        self.spec = spec or SpecSettings()
        self.device = next(target.parameters()).device
        self.head = isinstance(draft_model, Eagle3Head)
        vocab = int(target.config.get_text_config(decoder=True).vocab_size)
        if self.spec.topk != 1:
            raise HsxError(f"vision-language target ({model_type}): draft trees (topk {self.spec.topk}) are not run "
                           "on vision-language targets; draft a chain (--spec-topk 1)")
        if getattr(getattr(draft_model, "config", None), "vision_config", None) is not None:
            raise HsxError(f"vision-language target ({model_type}): the draft is a vision-language model "
                           f"({type(draft_model).__name__}); a draft is a text causal LM sharing the tokenizer, or an "
                           "EAGLE3 head")
        if self.head:
            # a one-layer head with its own attention: full attention over the slots the engine shows it
            self.draft = Driven(draft_model.eval(), AttentionPlan({FULL: None}, False), None)
            self.aux_sources = head_aux_boundaries(draft_model, target)
            draft_vocab = draft_model.target_vocab
        else:
            self.draft = Driven.of(draft_model, "draft model")
            self.aux_sources = ()
            draft_vocab = int(draft_model.config.vocab_size)
            if self.draft.plan.stateful:
                raise HsxError(f"vision-language target ({model_type}): a draft model with recurrent layers is not "
                               "run on vision-language targets (its state would take in the batch's padding)")
        if draft_vocab != vocab:
            raise HsxError(f"draft vocab {draft_vocab} != vision-language target's text vocab {vocab}")

    def start(self, rids, ids, mask, lengths, first, aux, capacity: int) -> BatchState:
        """Prefill the draft over the padded prompts ``ids [B, P]`` (placeholder ids at image tokens) at 1-D
        positions; ``first [B]`` is the target's first token, ``aux [B, P, K * H]`` a head's aux states."""
        batch, dev = len(rids), self.device
        valid = mask.bool()
        positions = prompt_positions(valid)
        block = prompt_block(valid, slice(0, ids.shape[1]))
        draft = KV(self.draft, batch, dev, capacity)
        pending_aux = None
        if self.head:
            # the head's slot t pairs token t+1 with the target's aux state after token t (as the text engine's);
            # the last prompt position waits for the first token
            nxt_valid = valid & torch.cat([valid[:, 1:], torch.zeros_like(valid[:, :1])], 1)
            nxt_ids = torch.cat([ids[:, 1:], ids[:, :1]], 1)
            draft.run(nxt_ids, positions, block & nxt_valid[:, None, :], draft_hidden=aux)
            draft.commit(nxt_valid)
            pending_aux = aux[torch.arange(batch, device=dev), lengths - 1][:, None]  # [B, 1, K * H]
        else:
            draft.run(ids, positions, block, **self.draft.no_logits(dev))
            draft.commit(valid)
        ones = torch.ones(batch, dtype=torch.long, device=dev)
        return BatchState(list(rids), None, draft, first[:, None], ones, torch.ones(batch, dtype=torch.long),
                          pending_aux)


def generate_speculative(engine, prompts, sampling: SamplingSettings):
    """``engine.generate`` with ``engine.drafts`` drafting: the finished samples by batch row and the batch's
    inputs (``engine._batch``), which the engine turns into :class:`hsx.engine.hf.vision.VisionSample` s."""
    from transformers import DynamicCache

    drafts: VisionDrafts = engine.drafts
    b = engine._batch(prompts)
    batch, dev, n = len(prompts), engine.device, drafts.spec.num_draft_tokens
    lengths = torch.tensor(b["lengths"], device=dev)
    next_pos = engine._decode_start(b)  # [B] where each row's first completion token sits
    generator = torch.Generator(device=dev).manual_seed(sampling.seed)
    collector = Collector(engine.groups, engine.store_dtype)
    rids = list(range(batch))
    windows = window_plan(engine.model)
    # sliding layers (Gemma 3): every slot kept, the window applied by position in each step's mask
    cache = DynamicCache() if windows else DynamicCache(config=engine.model.config)
    key_pos = torch.arange(b["ids"].shape[1], device=dev).expand(batch, -1)  # [B, K] the position each slot holds
    chain = torch.ones(n, n, dtype=torch.bool, device=dev).tril()  # a verify step's tokens see their chain's earlier ones
    stops = torch.tensor(sampling.stop_token_ids, dtype=torch.long)
    done: dict = {}
    capacity = max(b["lengths"]) + sampling.max_new_tokens + n + drafts.spec.pool_size
    arange = torch.arange(batch, device=dev)
    with torch.inference_mode(), engine._hooks(drafts.aux_sources) as hooks:
        out = engine._forward(b["ids"], b["mask"], b["positions"], cache, **b["extra"])
        first = _choose(out.logits[arange, lengths - 1], sampling, generator)  # [B]
        del out
        cols = hooks.columns(engine.groups)
        first_list = first.tolist()
        for i in rids:
            collector.prefill(i, torch.tensor(prompts[i].input_ids), {k: c[i, : b["lengths"][i]] for k, c in cols.items()},
                              first_list[i])
        aux = hooks.take(drafts.aux_sources) if drafts.head else None
        state = drafts.start(rids, b["ids"], b["mask"], lengths, first, aux, capacity)
        del aux, cols
        mask = b["mask"]
        _retire(state, first[:, None], torch.ones(batch, dtype=torch.long), torch.zeros(batch, dtype=torch.long),
                stops, sampling, collector, done)
        while len(done) < batch:
            tree = drafts._draft_tree(state)  # [B, n]: a chain, node j at depth j
            root = next_pos + state.n_out.to(dev) - 1  # [B] the position of the last emitted token
            mask = torch.cat([mask, torch.ones(batch, n, dtype=mask.dtype, device=dev)], 1)
            step_mask = mask
            if windows:
                q_pos = root[:, None] + tree.depth  # [B, n]
                key_pos = torch.cat([key_pos, q_pos], 1)
                visible = mask.bool()[:, None, :].expand(-1, n, -1).clone()  # [B, n, K]
                visible[:, :, -n:] &= chain
                step_mask = windows.masks(visible, q_pos, key_pos, engine.model.dtype)
            out = engine._forward(tree.tokens, step_mask, verify_positions(root, tree.depth, engine.spec.mrope), cache)
            target_tok = _choose(out.logits, sampling, generator)  # [B, n] the target's next token after each node
            del out
            # accept a draft when it and every draft before it is the target's choice at its parent
            match = tree.tokens[:, 1:] == target_tok[:, :-1]  # [B, n - 1]
            accept_lens = match.long().cumprod(1).sum(1) + 1  # [B] correct drafts + bonus
            keep = torch.arange(n, device=dev)[None, :] < accept_lens[:, None]  # [B, n] root and accepted drafts
            mask[:, -n:] = keep.to(mask.dtype)  # rejected slots: masked out of every later step
            dead = n - int(accept_lens.max())
            if dead:  # slots rejected in every row leave the cache's end
                cache.crop(-dead)
                mask, key_pos = mask[:, :-dead], key_pos[:, :-dead]
            cols = {k: c.reshape(batch * n, -1) for k, c in hooks.columns(engine.groups).items()}
            live = torch.tensor([i not in done for i in rids], device=dev)
            collector.step(rids, cols, target_tok, torch.where(live, accept_lens, 0), n)
            a_max = n - dead
            aux = hooks.take(drafts.aux_sources)[:, :a_max] if drafts.head else None
            n_out = state.n_out
            state = BatchState(rids, None, state.draft, target_tok[:, :a_max], accept_lens, n_out + accept_lens.cpu(),
                               aux)
            _retire(state, target_tok, accept_lens.cpu(), n_out, stops, sampling, collector, done)
    return done, b


def _retire(state, emitted, accept_lens, n_before, stops, sampling, collector, done) -> None:
    """Finish the rows whose step emitted a stop token or reached ``max_new_tokens`` (overshoot trimmed by
    the collector); ``emitted [B, n]``, ``accept_lens [B]`` and ``n_before [B]`` (completion tokens before
    the step) on any device, counted on the host."""
    emitted = emitted.cpu()
    in_step = torch.arange(emitted.shape[1])[None, :] < accept_lens[:, None]  # [B, n]
    is_stop = torch.isin(emitted, stops) & in_step
    stop_len = n_before + is_stop.to(torch.uint8).argmax(1) + 1  # finished length if the first stop counts
    has_stop = is_stop.any(1) & (stop_len <= sampling.max_new_tokens)
    finished = has_stop | (n_before + accept_lens >= sampling.max_new_tokens)
    for i in finished.nonzero()[:, 0].tolist():
        if i in done:
            continue
        length, reason = (int(stop_len[i]), "stop") if has_stop[i] else (sampling.max_new_tokens, "length")
        done[i] = collector.finish(state.rids[i], length, reason, speculative=True)
