"""Embedded transformers engine: batched plain or speculative decoding with aligned hidden rows.

One batched ``DynamicCache`` per model serves prompts of different lengths: every forward gets
explicit 2-D ``position_ids`` and a float 4-D mask ``[B, 1, q, past + q]`` that says which cache
slots each new token may see (its row's real tokens, plus its ancestors inside a draft tree);
sliding-window layers get their own mask, limited to keys within the window of the query's
position (``hsx.engine.families``).
After each forward the cache is compacted in one place (``KV.commit``) so it holds exactly the
tokens each row has accepted.

A speculative step drafts a tree (``topk == 1`` is a chain) with the draft model, verifies it with
ONE target forward over ``[root + drafts]``, and accepts the longest path whose tokens equal the
target's own choice at their parent (argmax when greedy; when sampling, one target sample per
node from a seeded generator, so every emitted token is a plain target sample). The accepted path
is moved to the front of each request's stride before the rows reach the ``Collector``, as
SGLang's EAGLE worker does. Plain decoding is the same step with a one-node tree (stride 1).

Only the boundaries a run stores (its layer groups, and an EAGLE3 head's aux states) are kept
from a forward, by hooks on the blocks and the final norm (:mod:`hsx.engine.hf.capture`); lm_head
runs only where logits are read: the rows' last prompt positions, the verify positions.

A prompt is prefilled in one forward, or ``prefill_chunk`` tokens at a time through the cache
(each chunk sees the committed slots of the chunks before it), so that the activations of a
forward are bounded by a chunk: the rows of each chunk are appended to its requests' rows.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

import torch

from hsx.align import FINAL, AlignedSample, Collector, LayerGroup, ModelShape, parse_layers, teacher_forced
from hsx.engine.hf.capture import MIN_TRANSFORMERS, Capture, Driven, forward
from hsx.engine.families import FULL, AttentionPlan, load_causal_lm, model_type
from hsx.heads.load import Eagle3Head, head_kind, load_eagle3_head
from hsx.engine.hf.batch_state import BatchState, admissible
from hsx.engine.hf.drafting import Drafting
from hsx.engine.hf.kv import KV
from hsx.engine.hf.slots import SlotLayer as _SlotLayer  # noqa: F401  (the cache layer, reached by tests under this name)
from hsx.heads.layer_ids import HF_READING, resolve_head_layers, sglang_boundaries
from hsx.engine.hf.prompt_batch import (PromptRows, pad_prompts, prompt_block, prompt_chunks, prompt_positions,
                                        prompt_tokens_in)
from hsx.engine.hf.tree import DraftTree
from hsx.errors import HsxError

__all__ = ["MIN_TRANSFORMERS", "HFEngine", "SamplingSettings", "SpecSettings", "StreamStats", "head_aux_boundaries",
           "load_draft", "load_hf_engine"]


@dataclass(frozen=True)
class SpecSettings:
    """Draft tree shape, named like SGLang's ``speculative_*`` flags."""

    num_steps: int = 3  # draft depth
    topk: int = 1  # children per expanded node: 1 = chain, > 1 = tree
    num_draft_tokens: int = 4  # verify stride, root included (a full chain: num_steps + 1)

    def __post_init__(self):
        if self.num_steps < 1 or self.topk < 1 or self.num_draft_tokens < 2:
            raise HsxError(f"speculative settings {self}: need num_steps >= 1, topk >= 1, num_draft_tokens >= 2")
        if self.num_draft_tokens - 1 > self.pool_size - 1:
            raise HsxError(
                f"speculative settings {self}: num_draft_tokens - 1 = {self.num_draft_tokens - 1} exceeds the "
                f"{self.pool_size - 1} nodes a depth-{self.num_steps} top-{self.topk} draft produces"
            )

    @property
    def pool_size(self) -> int:
        """Nodes drafted per step, root included: topk at depth 1, topk * topk at each deeper level."""
        return 1 + self.topk + (self.num_steps - 1) * self.topk * self.topk


@dataclass(frozen=True)
class SamplingSettings:
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()  # e.g. eos; the stop token is kept as the last completion token

    def __post_init__(self):
        if self.max_new_tokens < 1 or self.temperature < 0 or not 0 < self.top_p <= 1:
            raise HsxError(f"sampling settings {self}: need max_new_tokens >= 1, temperature >= 0, 0 < top_p <= 1")


@dataclass
class StreamStats:
    """How full the steps of the last :meth:`HFEngine.stream` ran."""

    admissions: int = 0  # prefill forwards that admitted waiting requests
    steps: int = 0  # decode / verify steps
    row_steps: int = 0  # requests summed over steps (steps * slots when always full)
    waiting_steps: int = 0  # steps taken while requests were waiting
    waiting_full: int = 0  # ... of those, steps with every row busy (continuous batching: all of them)
    widest_admission: int = 0  # padded prompt tokens of the largest admission of more than one request


def _choose(logits: torch.Tensor, sampling: SamplingSettings, generator: torch.Generator) -> torch.Tensor:
    """The target's (or first token's) choice per position of ``logits [..., V]``."""
    if sampling.temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / sampling.temperature, -1)
    if sampling.top_p < 1:
        sorted_p, idx = probs.sort(-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the top token always stays)
        sorted_p = sorted_p.masked_fill(sorted_p.cumsum(-1) - sorted_p > sampling.top_p, 0)
        probs = torch.zeros_like(probs).scatter(-1, idx, sorted_p)
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(logits.shape[:-1])


class HFEngine(Drafting):
    """Drives a transformers causal LM (and optionally a draft model) and returns aligned samples."""

    def __init__(
        self,
        model,
        groups: Sequence[LayerGroup],
        *,
        draft_model=None,
        spec: SpecSettings | None = None,
        store_dtype: torch.dtype = torch.bfloat16,
        padding_side: str = "right",
        prefill_chunk: int | None = None,
    ):
        if padding_side not in ("left", "right"):
            raise HsxError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
        if prefill_chunk is not None and (isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int)
                                          or prefill_chunk < 1):
            raise HsxError(f"prefill_chunk must be a number of tokens >= 1 (or None: each prompt in one forward), "
                           f"got {prefill_chunk!r}")
        self.prefill_chunk = prefill_chunk
        self.target = Driven.of(model, "target model")
        self.model = self.target.model
        self.groups = list(groups)
        self.shape = ModelShape.from_config(model.config)
        self.device = next(model.parameters()).device
        self.store_dtype = store_dtype
        self.padding_side = padding_side
        self.stats = StreamStats()
        self.on_tokens = None  # a progress callback (Runner.watch_tokens): prompt tokens, generated tokens
        self.vocab_size = int(model.config.vocab_size)
        self.head = isinstance(draft_model, Eagle3Head)
        self.aux_sources: tuple[int, ...] = ()
        if self.head:
            # a one-layer head with its own attention: full attention over the slots the engine shows it
            self.draft = Driven(draft_model.eval(), AttentionPlan({FULL: None}, False), None)
            self.aux_sources = head_aux_boundaries(draft_model, model)
        else:
            self.draft = None if draft_model is None else Driven.of(draft_model, "draft model")
        self.draft_model = None if draft_model is None else self.draft.model
        self.spec = None if draft_model is None else (spec or SpecSettings())
        if self.head:
            if draft_model.target_vocab != self.vocab_size:
                raise HsxError(f"EAGLE3 head built for vocab {draft_model.target_vocab} != target vocab {self.vocab_size}")
        elif draft_model is not None:
            if int(draft_model.config.vocab_size) != self.vocab_size:
                raise HsxError(f"draft vocab {draft_model.config.vocab_size} != target vocab {self.vocab_size}")
        elif spec is not None:
            raise HsxError("speculative settings given without a draft model")
        for g in self.groups:
            bad = [s for s in g.sources if s != FINAL and not 0 <= s <= self.shape.num_layers]
            if bad:
                raise HsxError(f"layer group {g.name!r}: boundaries {bad} outside 0..{self.shape.num_layers}")
        self.stateful = self.target.plan.stateful or (self.draft is not None and self.draft.plan.stateful)
        if self.stateful:
            self._check_stateful()
        # what a target forward keeps: the groups' boundaries and the head's aux states
        self.sources = tuple(dict.fromkeys([s for g in self.groups for s in g.sources] + list(self.aux_sources)))

    # ---- public entry points -------------------------------------------------------------

    def prefill(self, requests: Sequence[tuple[object, torch.Tensor]]) -> list[AlignedSample]:
        """Teacher-forced rows for every position of each sequence: one batched forward, or one per
        ``prefill_chunk`` prompt slots through the cache. No logits are computed."""
        rids, prompts = self._check_requests(requests)
        if not rids:
            return []
        ids, valid = pad_prompts(prompts, self.padding_side, self.device)  # [B, P]
        positions = prompt_positions(valid)
        parts = prompt_chunks(ids.shape[1], self.prefill_chunk)
        rows = PromptRows(len(rids), self.store_dtype)
        no_logits = self.target.no_logits(self.device)
        with torch.inference_mode(), self._capture() as cap:
            # one forward needs no cache; a part sees the parts before it through the cache's committed slots
            kv = None if len(parts) == 1 else KV(self.target, len(rids), self.device, ids.shape[1])
            for part in parts:
                block = prompt_block(valid, part)
                if kv is None:
                    forward(self.target, ids, positions, positions, block, None, **no_logits)
                else:
                    kv.run(ids[:, part], positions[:, part], block, **no_logits)
                    # a recurrent layer keeps a row's padding in its state: harmless on the right, where no
                    # real token of the row comes after it
                    kv.commit(torch.ones_like(valid[:, part]) if self.target.plan.stateful else valid[:, part])
                rows.add(self._columns(cap), valid[:, part])  # name -> [B, q, W]
                cap.clear()
                self._tell(prompt=prompt_tokens_in(prompts, self.padding_side, part))
            return [teacher_forced(prompts[i], rows.of(i), self.groups, self.store_dtype) for i in range(len(rids))]

    def generate(self, requests: Sequence[tuple[object, torch.Tensor]], sampling: SamplingSettings) -> list[AlignedSample]:
        """Decode every request in one batch; samples come back in request order."""
        requests = list(requests)
        done = dict(self.stream(requests, sampling, slots=max(len(requests), 1)))
        return [done[rid] for rid, _ in requests]

    def stream(self, requests: Iterable[tuple[object, torch.Tensor]], sampling: SamplingSettings, *, slots: int,
               max_prefill_tokens: int | None = None) -> Iterator[tuple[object, AlignedSample]]:
        """Continuous batching: up to ``slots`` requests decode together, and when one finishes the next
        waiting one is prefilled and takes its row. Yields ``(rid, sample)`` as requests finish.

        Requests are admitted in the order given; one admission prefills as many as fit the free rows
        and ``max_prefill_tokens`` padded prompt tokens (at least one). A row's values depend on which
        requests shared its steps, so the same requests in the same order give the same bits.
        """
        rids, prompts = self._check_requests(list(requests))
        waiting = deque(zip(rids, prompts))
        if slots < 1:
            raise HsxError(f"slots must be >= 1, got {slots}")
        generator = torch.Generator(device=self.device).manual_seed(sampling.seed)
        collector = Collector(self.groups, self.store_dtype)
        stride = 1 if self.spec is None else self.spec.num_draft_tokens
        state = None
        self.stats = stats = StreamStats()
        # the first batch allocates its cache for the longest prompt's whole run; later ones are copied into it
        extra = sampling.max_new_tokens + stride + (0 if self.spec is None else self.spec.pool_size)
        capacity = max((p.numel() for p in prompts), default=0) + extra
        with torch.inference_mode():
            while waiting or (state is not None and len(state.rids) > len(state.free)):
                busy = 0 if state is None else len(state.rids) - len(state.free)
                if waiting and busy < slots:
                    batch = admissible(waiting, slots - busy, max_prefill_tokens, same_length=self.stateful)
                    stats.admissions += 1
                    if len(batch) > 1:
                        width = len(batch) * max(p.numel() for _, p in batch)
                        stats.widest_admission = max(stats.widest_admission, width)
                    new = self._start([r for r, _ in batch], [p for _, p in batch], collector, sampling, generator,
                                      capacity if state is None else 0)
                    new, finished = self._retire(new, new.pending, new.pending_len, sampling, collector, new.pending_aux)
                    yield from finished
                    state = new if state is None else state.admit(new)
                    continue
                if state.free:  # nothing waits: the finished requests' rows leave the batch
                    state = state.without(state.free)
                    continue
                stats.steps, stats.row_steps = stats.steps + 1, stats.row_steps + len(state.rids)
                if waiting:
                    stats.waiting_steps += 1
                    stats.waiting_full += len(state.rids) == slots
                tree = self._draft_tree(state) if self.draft_model is not None else DraftTree.start(state.root, 1)
                emitted, accept_lens, hidden, aux = self._verify(state, tree, sampling, generator)
                collector.step(state.rids, hidden, emitted, accept_lens, stride)
                state, finished = self._retire(state, emitted, accept_lens, sampling, collector, aux)
                yield from finished

    # ---- steps ---------------------------------------------------------------------------

    def _start(self, rids, prompts, collector, sampling, generator, capacity: int = 0) -> BatchState:
        """Prefill both models over the padded prompts, in one forward or one per ``prefill_chunk`` slots;
        the target picks each request's first token. ``capacity`` is the cache slots per row to allocate ahead."""
        batch, dev = len(rids), self.device
        ids, valid = pad_prompts(prompts, self.padding_side, dev)  # [B, P]
        positions = prompt_positions(valid)
        last = (valid.long() * torch.arange(valid.shape[1], device=dev)).argmax(1).cpu()  # [B] last real slot
        target = KV(self.target, batch, dev, capacity)
        draft = None if self.draft is None else KV(self.draft, batch, dev, capacity)
        # the head's slot t pairs token t+1 with the target's aux state after token t (SGLang's draft extend);
        # the last prompt position waits for the first token, as the pending step
        nxt_valid = valid & torch.cat([valid[:, 1:], valid[:, :1] & False], 1)
        nxt_ids = torch.cat([ids[:, 1:], ids[:, :1]], 1)
        rows = PromptRows(batch, self.store_dtype)
        last_logits = pending_aux = None  # [B, V], head: [B, 1, K * H]
        with self._capture() as cap:
            for part in prompt_chunks(ids.shape[1], self.prefill_chunk):
                block = prompt_block(valid, part)
                ending = ((last >= part.start) & (last < part.stop)).nonzero()[:, 0]  # rows whose prompt ends here
                offset = last[ending] - part.start  # [e] their last slot within the part
                # logits only at those rows' last positions (a few distinct ones), not [B, q, V]
                if not ending.numel():
                    keep, which = self.target.no_logits(dev), None
                elif self.target.slices_logits:
                    wanted, which = torch.unique(offset, return_inverse=True)
                    keep = self.target.logits_at(wanted.to(dev))
                else:
                    keep, which = {}, offset
                out = target.run(ids[:, part], positions[:, part], block, **keep)
                target.commit(valid[:, part])
                ending, offset = ending.to(dev), offset.to(dev)
                if ending.numel():
                    chosen = out.logits[ending, which.to(dev)]  # [e, V]
                    last_logits = chosen.new_empty(batch, chosen.shape[-1]) if last_logits is None else last_logits
                    last_logits[ending] = chosen
                del out
                rows.add(self._columns(cap), valid[:, part])
                self._tell(prompt=prompt_tokens_in(prompts, self.padding_side, part))
                if self.head:
                    aux = cap.take(self.aux_sources)  # [B, q, K * H]
                    draft.run(nxt_ids[:, part], positions[:, part], block & nxt_valid[:, None, part], draft_hidden=aux)
                    draft.commit(nxt_valid[:, part])
                    if ending.numel():
                        pending_aux = aux.new_zeros(batch, 1, aux.shape[2]) if pending_aux is None else pending_aux
                        pending_aux[ending, 0] = aux[ending, offset]
                    del aux
                elif draft is not None:  # its prompt logits are not read: the catch-up gives the root's
                    draft.run(ids[:, part], positions[:, part], block, **self.draft.no_logits(dev))
                    draft.commit(valid[:, part])
                cap.clear()
        first = _choose(last_logits, sampling, generator)  # [B]
        first_list = first.tolist()
        for i, rid in enumerate(rids):
            collector.prefill(rid, prompts[i], rows.of(i), first_list[i])
        ones = torch.ones(batch, dtype=torch.long, device=dev)
        return BatchState(list(rids), target, draft, first[:, None], ones, torch.zeros(batch, dtype=torch.long),
                      pending_aux)

    def _verify(self, state: BatchState, tree: DraftTree, sampling, generator):
        """One target forward over ``[root + drafts]``; returns emitted tokens ``[B, n]``, accept lengths
        ``[B]`` and rows ``{name: [B * n, W]}``, each request's accepted path at the front of its stride."""
        batch, n = tree.tokens.shape
        target = state.target
        positions = target.lengths[:, None] + tree.depth  # [B, n]
        with self._capture() as cap:
            # logits at every node: each one is read
            out = target.run(tree.tokens, positions, tree.anc, partial=self.spec is not None)
        target_tok = _choose(out.logits, sampling, generator)  # [B, n] the target's next token after each node

        # accept a node when it and every ancestor below the root is the target's choice at its parent;
        # siblings carry distinct tokens, so the accepted nodes form one path from the root
        match = tree.tokens == target_tok.gather(1, tree.parents)  # [B, n]
        match[:, 0] = True
        accepted = ~(tree.anc & ~match[:, None, :]).any(2)  # [B, n]
        leaf = (tree.depth * accepted).argmax(1)  # [B] deepest accepted node (root when none)
        accept_lens = tree.depth.gather(1, leaf[:, None])[:, 0] + 1  # [B] correct drafts + bonus
        on_path = tree.anc[torch.arange(batch, device=self.device), leaf]  # [B, n]
        # path first (root -> leaf), then the rejected nodes; rows and tokens are cut with this one index
        key = torch.where(on_path, tree.depth, n + torch.arange(n, device=self.device))
        path = key.argsort(1)  # [B, n]
        emitted = target_tok.gather(1, path)  # [B, n] accepted drafts then the bonus token
        cols = self._columns(cap)  # name -> [B, n, W]
        hidden = {
            name: c.gather(1, path[:, :, None].expand(-1, -1, c.shape[2])).reshape(batch * n, -1)
            for name, c in cols.items()
        }
        target.commit(on_path)  # the target keeps exactly the root and the accepted drafts
        aux = None
        if self.head:  # the head's next catch-up reads the aux states along the accepted path
            aux = cap.take(self.aux_sources)
            aux = aux.gather(1, path[:, :, None].expand(-1, -1, aux.shape[2]))
        return emitted, accept_lens, hidden, aux

    def _retire(self, state: BatchState, emitted, accept_lens, sampling, collector, aux=None) -> tuple[BatchState, list]:
        """Count the step's emitted tokens, finish requests that hit a stop token or max_new_tokens.

        Returns the state, whose finished rows now hold ``None`` as their request id (free rows),
        and the finished ``(rid, sample)`` pairs."""
        emitted_cpu, accept_cpu = emitted.cpu(), accept_lens.cpu()
        stride = emitted_cpu.shape[1]
        in_step = torch.arange(stride)[None, :] < accept_cpu[:, None]  # [B, stride]
        stops = torch.tensor(sampling.stop_token_ids, dtype=torch.long)
        is_stop = torch.isin(emitted_cpu, stops) & in_step
        stop_len = state.n_out + is_stop.to(torch.uint8).argmax(1) + 1  # finished length if the first stop counts
        has_stop = is_stop.any(1) & (stop_len <= sampling.max_new_tokens)
        n_out = state.n_out + accept_cpu
        finished = has_stop | (n_out >= sampling.max_new_tokens)
        if self.on_tokens is not None:
            self._tell_generated(state, has_stop, stop_len, n_out, finished, sampling.max_new_tokens)
        rids, out = list(state.rids), []
        for i in finished.nonzero()[:, 0].tolist():
            length, reason = (int(stop_len[i]), "stop") if has_stop[i] else (sampling.max_new_tokens, "length")
            out.append((rids[i], collector.finish(rids[i], length, reason, speculative=self.draft_model is not None)))
            rids[i] = None
        a_max = int(accept_cpu.max())
        state = BatchState(rids, state.target, state.draft, emitted[:, :a_max], accept_lens, n_out,
                       None if aux is None else aux[:, :a_max])
        return state, out

    # ---- helpers -------------------------------------------------------------------------

    def _tell(self, **counts: int) -> None:
        """Token counts for the progress callback, if there is one."""
        if self.on_tokens is not None:
            self.on_tokens(**counts)

    def _tell_generated(self, state: BatchState, has_stop, stop_len, n_out, finished, max_new: int) -> None:
        """A step's tokens kept (overshoot past a stop or ``max_new`` not counted), and the budget the
        requests finishing early give back; host tensors ``[B]``, free rows left out."""
        live = torch.tensor([rid is not None for rid in state.rids])
        kept = torch.where(has_stop, stop_len, n_out.clamp(max=max_new))  # [B] each request's length after the step
        self._tell(generated=int((kept - state.n_out).clamp(min=0)[live].sum()),
                   budget=-int((max_new - kept)[finished & live].sum()))

    def _check_stateful(self) -> None:
        """What recurrent layers rule out, refused before the first forward (hsx.engine.hf.state)."""
        for driven, what in ((self.target, "target model"), (self.draft, "draft model")):
            if driven is None or not driven.plan.stateful:
                continue
            kinds = ", ".join(map(repr, driven.plan.state_kinds))
            if self.padding_side == "left":
                raise HsxError(f"{what} ({model_type(driven.model)}): {kinds} layers keep a state per row, which "
                               f"left padding would enter before the prompt; use padding_side='right'")
            if self.spec is not None and self.spec.topk > 1:
                raise HsxError(f"{what} ({model_type(driven.model)}): {kinds} layers keep one state per row, which "
                               f"a draft tree's branches cannot share; draft a chain (topk 1, --spec-topk 1)")

    def _capture(self) -> Capture:
        """Hooks keeping what a target forward's rows are made of, and nothing else."""
        return Capture(self.target, self.sources, self.shape.num_layers)

    def _columns(self, cap: Capture) -> dict[str, torch.Tensor]:
        """Each group's ``[B, q, W]``: its sources concatenated along the width in the order given."""
        return {g.name: cap.take(g.sources) for g in self.groups}

    def _check_requests(self, requests) -> tuple[list, list[torch.Tensor]]:
        rids = [rid for rid, _ in requests]
        if any(rid is None for rid in rids):
            raise HsxError("a request id is None (ids name the samples; None marks a free batch row)")
        if len(set(rids)) != len(rids):
            raise HsxError(f"request ids repeat in one batch: {rids}")
        prompts = []
        for rid, ids in requests:
            ids = torch.as_tensor(ids).reshape(-1).to(torch.long).cpu()
            if ids.numel() == 0:
                raise HsxError(f"request {rid!r}: empty prompt (at least one token is needed)")
            if int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size:
                raise HsxError(f"request {rid!r}: token ids outside 0..{self.vocab_size - 1}")
            prompts.append(ids)
        return rids, prompts


def head_aux_boundaries(head: Eagle3Head, target) -> tuple[int, ...]:
    """The target boundaries an EAGLE3 head reads: its layer ids by the rule its ``hsx`` marker names
    (``vllm``: boundary = id), else by SGLang's rule (id + 1 for Llama-style targets: the output of layer
    id), the rule of the heads this engine runs; the model's default when the head names none
    (:func:`hsx.heads.layer_ids.resolve_head_layers`)."""
    num_layers = int(target.config.get_text_config(decoder=True).num_hidden_layers)
    model_type = getattr(target.config, "model_type", None)
    config = getattr(head, "head_config", None)
    if config is None:  # a head built without its config dict: its ids, unmarked
        config = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": head.aux_ids}}
    try:
        layers = resolve_head_layers(config, HF_READING, model_type, num_layers)
    except HsxError as e:
        raise HsxError(f"EAGLE3 head {head.path!r}: {e}") from None
    bounds = layers.boundaries if layers.boundaries is not None else sglang_boundaries(None, model_type, num_layers)
    if len(bounds) != head.num_aux or any(not 0 <= b <= num_layers for b in bounds):
        raise HsxError(f"EAGLE3 head {head.path!r}: aux layer ids {head.aux_ids} read boundaries {list(bounds)}; "
                       f"expected {head.num_aux} boundaries within 0..{num_layers}")
    return tuple(bounds)


def load_draft(path: str, target, dtype: torch.dtype, trust_remote_code: bool = False):
    """A draft for ``target``: an EAGLE3 head when ``path`` is in SGLang's head format, else a causal LM."""
    kind = head_kind(path)
    if kind == "eagle3":
        return load_eagle3_head(path, target, dtype)
    if kind == "eagle":
        raise HsxError(f"draft {path!r} is an EAGLE (LlamaForCausalLMEagle) head; the transformers engine runs "
                       f"EAGLE3 heads and draft language models only (use --engine sglang for EAGLE heads)")
    return load_causal_lm(path, dtype, trust_remote_code, what="draft model")


def load_hf_engine(
    model_path: str,
    layers: str | Sequence[LayerGroup] = "final",
    *,
    draft_path: str | None = None,
    spec: SpecSettings | None = None,
    eagle3_ids: Sequence[int] | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    store_dtype: torch.dtype = torch.bfloat16,
    padding_side: str = "right",
    trust_remote_code: bool = False,
    prefill_chunk: int | None = None,
) -> HFEngine:
    """Load a target (and optional draft) with ``AutoModelForCausalLM`` and build an :class:`HFEngine`."""
    model = load_causal_lm(model_path, dtype, trust_remote_code, what="target model").to(device).eval()
    groups = parse_layers(layers, ModelShape.from_config(model.config), eagle3_ids) if isinstance(layers, str) else list(layers)
    draft = None if draft_path is None else load_draft(draft_path, model, dtype, trust_remote_code).to(device).eval()
    return HFEngine(model, groups, draft_model=draft, spec=spec, store_dtype=store_dtype, padding_side=padding_side,
                    prefill_chunk=prefill_chunk)
