"""Embedded transformers engine: batched plain or speculative decoding with aligned hidden rows.

One batched ``DynamicCache`` per model serves prompts of different lengths: every forward gets
explicit 2-D ``position_ids`` and a float 4-D mask ``[B, 1, q, past + q]`` that says which cache
slots each new token may see (its row's real tokens, plus its ancestors inside a draft tree);
sliding-window layers get their own mask, limited to keys within the window of the query's
position (``hsx.engine.families``).
After each forward the cache is compacted in one place (``_KV.commit``) so it holds exactly the
tokens each row has accepted.

A speculative step drafts a tree (``topk == 1`` is a chain) with the draft model, verifies it with
ONE target forward over ``[root + drafts]``, and accepts the longest path whose tokens equal the
target's own choice at their parent (argmax when greedy; when sampling, one target sample per
node from a seeded generator, so every emitted token is a plain target sample). The accepted path
is moved to the front of each request's stride before the rows reach the ``Collector``, as
SGLang's EAGLE worker does. Plain decoding is the same step with a one-node tree (stride 1).

Boundary ``b < L`` is ``hidden_states[b]``; boundary ``L`` (pre-norm output of the last block)
and ``final`` (lm_head's input) are the input and output of the final norm, found in the module
tree and checked on one short forward before the engine is used (``families.check_layout``).
"""

from __future__ import annotations

import inspect
from collections import deque
from dataclasses import dataclass
from functools import partial
from typing import Iterable, Iterator, Sequence

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from hsx.align import FINAL, AlignedSample, Collector, LayerGroup, ModelShape, parse_layers, teacher_forced
from hsx.engine.families import FULL, AttentionPlan, Layout, check_layout, find_layout, load_causal_lm
from hsx.engine.heads import Eagle3Head, head_kind, load_eagle3_head
from hsx.errors import HsxError


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


# The oldest transformers this engine is tested with: it passes the cache as ``cache=``, which
# older releases ignore silently (5.19 runs every forward without a cache).
MIN_TRANSFORMERS = "5.24"


def _check_transformers() -> None:
    import transformers
    from packaging.version import Version

    if Version(transformers.__version__) < Version(MIN_TRANSFORMERS):
        raise HsxError(f"the transformers engine needs transformers >= {MIN_TRANSFORMERS}, found "
                       f"{transformers.__version__} (the SGLang engine does not have this limit)")


@dataclass(frozen=True)
class _Driven:
    """A model with what the engine learned about it before its first forward."""

    model: torch.nn.Module
    plan: AttentionPlan
    layout: Layout
    slices_logits: bool = False  # forward takes logits_to_keep: lm_head runs only where logits are read

    @staticmethod
    def of(model, what: str) -> "_Driven":
        _check_transformers()
        model = model.eval()  # the layout check compares tensors of one forward: no dropout
        plan = AttentionPlan.from_model(model, what)
        layout = find_layout(model, what)
        check_layout(model, layout, what)
        return _Driven(model, plan, layout, "logits_to_keep" in inspect.signature(model.forward).parameters)

    def logits_at(self, positions: torch.Tensor | int) -> dict:
        """Forward keywords computing logits only at ``positions`` (a 1-D tensor of sequence indices,
        the same for every row; or an int: that many last positions), where the model can."""
        return {"logits_to_keep": positions} if self.slices_logits else {}


class _NormTap:
    """Captures the final norm's input (boundary L, which ``output_hidden_states`` does not return)
    and its output (``final``, lm_head's input)."""

    def __init__(self, driven: _Driven):
        self.norm = driven.layout.norm(driven.model)
        self.pre: torch.Tensor | None = None
        self.post: torch.Tensor | None = None

    def __enter__(self):
        self.handle = self.norm.register_forward_hook(self._hook)
        return self

    def _hook(self, module, args, output):
        self.pre, self.post = args[0], output

    def __exit__(self, *exc):
        self.handle.remove()


def _forward(driven: _Driven, input_ids, q_pos, k_pos, visible, cache, hidden: bool, **extra):
    """One forward of ``input_ids [B, q]`` at positions ``q_pos [B, q]`` that sees the key slots
    (at positions ``k_pos [B, K]``, the new ones last) where ``visible [B, q, K]``."""
    batch, q = input_ids.shape
    visible = visible.clone()
    diag = torch.arange(q, device=visible.device)
    # every query sees itself: a fully masked row turns into NaN under eager attention
    visible[:, diag, visible.shape[2] - q + diag] = True
    model = driven.model
    return model(
        input_ids=input_ids,
        position_ids=q_pos,
        attention_mask=driven.plan.masks(visible, q_pos, k_pos, model.dtype),
        cache=cache,
        use_cache=cache is not None,
        output_hidden_states=hidden,
        **extra,
    )


class _SlotLayer(DynamicLayer):
    """One layer's keys and values in storage ``[B, heads, capacity, head_dim]`` allocated ahead:
    appending writes into it instead of copying the whole cache (``DynamicLayer`` concatenates), and
    ``keys``/``values`` are views of the used width. Grows by doubling when the capacity runs out."""

    def __init__(self, capacity: int = 0):
        super().__init__()
        self.capacity_hint = capacity
        self.width = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.k_buf = key_states.new_zeros(*key_states.shape[:2], 0, key_states.shape[3])
        self.v_buf = value_states.new_zeros(*value_states.shape[:2], 0, value_states.shape[3])
        self.is_initialized = True
        self.reserve(max(self.capacity_hint, key_states.shape[2]))

    def reserve(self, need: int) -> None:
        """Room for ``need`` slots per row, keeping the used ones."""
        cap = self.k_buf.shape[2]
        if need <= cap:
            return
        cap = max(need, 2 * cap)
        for name in ("k_buf", "v_buf"):
            old = getattr(self, name)
            new = old.new_zeros(*old.shape[:2], cap, old.shape[3])  # never garbage: a masked NaN still poisons a softmax
            new[:, :, : self.width] = old[:, :, : self.width]
            setattr(self, name, new)
        self._views()

    def _views(self) -> None:
        self.keys, self.values = self.k_buf[:, :, : self.width], self.v_buf[:, :, : self.width]

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.width + key_states.shape[2]
        self.reserve(end)
        self.k_buf[:, :, self.width : end] = key_states
        self.v_buf[:, :, self.width : end] = value_states
        self.width = end
        self._views()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.width

    def set_width(self, width: int) -> None:
        self.width = width
        self._views()

    def move(self, start: int, order: torch.Tensor, dest: torch.Tensor) -> None:
        """Slots ``start + order [B, m]`` of each row go to slots ``dest [B, m]`` (read all, then write)."""
        rows = torch.arange(order.shape[0], device=order.device)[:, None].expand_as(order)
        for buf in (self.k_buf, self.v_buf):
            buf[rows, :, dest] = buf[rows, :, start + order]  # [B, m, heads, dim]

    def select(self, rows: torch.Tensor) -> None:
        self.k_buf, self.v_buf = self.k_buf[rows], self.v_buf[rows]
        self._views()

    def put(self, rows: torch.Tensor, other: "_SlotLayer", src: torch.Tensor) -> None:
        """Rows ``rows`` take ``other``'s rows ``src``, from slot 0 (only their used slots are copied)."""
        w = other.width
        self.reserve(w)
        self.k_buf[rows, :, :w] = other.k_buf[src, :, :w]
        self.v_buf[rows, :, :w] = other.v_buf[src, :, :w]

    def extend(self, other: "_SlotLayer", src: torch.Tensor) -> None:
        """Append ``other``'s rows ``src`` to the batch."""
        self.reserve(other.width)
        for name in ("k_buf", "v_buf"):
            mine, theirs = getattr(self, name), getattr(other, name)[src, :, : other.width]
            setattr(self, name, torch.cat([mine, torch.nn.functional.pad(theirs, (0, 0, 0, mine.shape[2] - theirs.shape[2]))]))
        self._views()


class _SlotCache(DynamicCache):
    """A ``DynamicCache`` of :class:`_SlotLayer` (full-length layers everywhere: see :class:`_KV`)."""

    def __init__(self, capacity: int = 0):
        Cache.__init__(self, layer_class_to_replicate=partial(_SlotLayer, capacity))


class _KV:
    """A batched cache plus, per row, how many committed slots hold that row's tokens, and every slot's position.

    Rows stay compacted: row i's tokens are slots ``[0, lens[i])``; slots from there to the committed
    width are stale. Slot order does not matter to attention (positions are baked into the keys,
    visibility is the mask), so a row's tokens may sit in any order inside that prefix. Every layer
    keeps every slot, sliding ones included (transformers' sliding cache layers drop old slots by
    count, which is wrong for rows of different lengths); the window is applied by the mask, from
    the slots' positions. Storage is allocated ahead (``capacity`` slots per row) so a step writes
    only its new slots.
    """

    def __init__(self, driven: _Driven, batch: int, device, capacity: int = 0):
        self.driven = driven
        self.cache = _SlotCache(capacity)
        self.lens = torch.zeros(batch, dtype=torch.long, device=device)  # [B] committed tokens per row
        self.width = 0  # committed slots (max of lens)
        self._pos = torch.zeros(batch, max(capacity, 1), dtype=torch.long, device=device)  # every slot's position
        self.filled = 0  # slots written: the committed width plus those not committed yet

    @property
    def lengths(self) -> torch.Tensor:
        return self.lens  # [B] tokens seen == position of the next token

    @property
    def pos(self) -> torch.Tensor:
        return self._pos[:, : self.filled]

    def run(self, input_ids, positions, block, hidden: bool = False, **extra):
        """Forward ``input_ids [B, q]`` at ``positions [B, q]``; ``block [B, q, uncommitted + q]`` is
        visibility among new slots."""
        batch, q = input_ids.shape
        seen = torch.arange(self.width, device=self.lens.device)[None, :] < self.lens[:, None]  # [B, S]
        seen = seen[:, None, :].expand(batch, q, -1)
        end = self.filled + q
        self._reserve_pos(end)
        self._pos[:, self.filled : end] = positions
        self.filled = end
        return _forward(self.driven, input_ids, positions, self.pos, torch.cat([seen, block], 2), self.cache, hidden,
                        **extra)

    def commit(self, keep: torch.Tensor) -> None:
        """Keep the slots appended since the last commit where ``keep [B, n]``; drop the rest.

        The only place a row's tokens move: its kept new slots go right after its committed ones
        (the rest are left behind as stale slots). Work is proportional to the new slots only.
        """
        start, n = self.width, keep.shape[1]
        if self.cache.get_seq_length() != start + n or self.filled != start + n:
            raise RuntimeError(f"cache holds {self.cache.get_seq_length()} slots ({self.filled} positions), "
                               f"commit describes {start} + {n}")
        kept = keep.sum(1)
        order = torch.sort((~keep).to(torch.uint8), dim=1, stable=True).indices  # [B, n] kept slots first
        dest = self.lens[:, None] + torch.arange(n, device=keep.device)  # [B, n]
        if n and bool(kept.any()) and not bool((dest == start + order).all()):
            for layer in self.cache.layers:
                layer.move(start, order, dest)
            self._pos.scatter_(1, dest, self._pos[:, start : start + n].gather(1, order))
        self.lens = self.lens + kept
        self.width = int(self.lens.max()) if self.lens.numel() else 0
        self.filled = self.width
        for layer in self.cache.layers:
            layer.set_width(self.width)

    def select(self, rows: torch.Tensor) -> None:
        """Keep only batch rows ``rows`` (finished requests leave the batch)."""
        self._check_committed("select")
        for layer in self.cache.layers:
            layer.select(rows)
        self.lens, self._pos = self.lens[rows], self._pos[rows]
        self.commit(self._none())

    def put(self, rows: torch.Tensor, other: "_KV", src: torch.Tensor) -> None:
        """Rows ``rows`` of this batch take the requests in rows ``src`` of ``other`` (a freed row is
        overwritten in place: only the new request's slots are copied)."""
        self._check_committed("put")
        other._check_committed("put")
        for layer, theirs in zip(self.cache.layers, other.cache.layers):
            layer.put(rows, theirs, src)
        self._reserve_pos(other.width)
        self._pos[rows, : other.width] = other._pos[src, : other.width]
        self.lens = self.lens.clone()
        self.lens[rows] = other.lens[src]
        self.commit(self._none())

    def extend(self, other: "_KV", src: torch.Tensor) -> None:
        """Append the requests in rows ``src`` of ``other`` to this batch."""
        self._check_committed("extend")
        other._check_committed("extend")
        for layer, theirs in zip(self.cache.layers, other.cache.layers):
            layer.extend(theirs, src)
        self._reserve_pos(other.width)
        theirs = other._pos[src, : other.width]
        self._pos = torch.cat([self._pos, torch.nn.functional.pad(theirs, (0, self._pos.shape[1] - theirs.shape[1]))])
        self.lens = torch.cat([self.lens, other.lens[src]])
        self.commit(self._none())

    def _reserve_pos(self, need: int) -> None:
        if need > self._pos.shape[1]:
            grown = self._pos.new_zeros(self._pos.shape[0], max(need, 2 * self._pos.shape[1]))
            grown[:, : self.filled] = self._pos[:, : self.filled]
            self._pos = grown

    def _none(self) -> torch.Tensor:
        return torch.zeros(self.lens.shape[0], 0, dtype=torch.bool, device=self.lens.device)  # a commit of no slots

    def _check_committed(self, what: str) -> None:
        if self.filled != self.width:
            raise RuntimeError(f"{what} with {self.filled - self.width} uncommitted slots")


@dataclass
class _Tree:
    """Draft trees, one per request, root (the last emitted token) at node 0, parents before children."""

    tokens: torch.Tensor  # [B, n]
    parents: torch.Tensor  # [B, n] node index; the root is its own parent
    depth: torch.Tensor  # [B, n]
    anc: torch.Tensor  # [B, n, n] bool: anc[b, i, j] = j is i or an ancestor of i
    score: torch.Tensor  # [B, n] cumulative draft log-prob (0 at the root)

    @staticmethod
    def start(root: torch.Tensor, size: int) -> "_Tree":
        """Room for ``size`` nodes, filled by :meth:`add`; ``size == 1`` is plain decoding's tree."""
        batch, dev = root.shape[0], root.device
        zeros = torch.zeros(batch, size, dtype=torch.long, device=dev)
        tree = _Tree(zeros.clone(), zeros.clone(), zeros.clone(),
                     torch.zeros(batch, size, size, dtype=torch.bool, device=dev), zeros.float())
        tree.tokens[:, 0], tree.anc[:, 0, 0] = root, True
        return tree

    def add(self, start: int, tokens, scores, parents, level: int) -> torch.Tensor:
        """Fill nodes ``start, start + 1, ...`` with children of ``parents [B, c]``; returns their indices."""
        idx = torch.arange(start, start + tokens.shape[1], device=tokens.device)
        self.tokens[:, idx], self.score[:, idx], self.parents[:, idx], self.depth[:, idx] = tokens, scores, parents, level
        self.anc[:, idx] = self.anc.gather(1, parents[:, :, None].expand(-1, -1, self.anc.shape[2]))
        self.anc[:, idx, idx] = True
        return idx

    def visibility(self, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """``[B, q, k]``: which of the nodes ``keys [B, k]`` each node of ``queries [B, q]`` descends from (or is)."""
        rows = self.anc.gather(1, queries[:, :, None].expand(-1, -1, self.anc.shape[2]))  # [B, q, M]
        return rows.gather(2, keys[:, None, :].expand(-1, queries.shape[1], -1))

    def subtree(self, nodes: torch.Tensor) -> "_Tree":
        """The nodes ``[B, n]`` (ancestor-closed, root first), renumbered 0..n-1."""
        batch, n = nodes.shape
        slot_of = torch.full(self.tokens.shape, -1, dtype=torch.long, device=nodes.device)
        slot_of.scatter_(1, nodes, torch.arange(n, device=nodes.device).expand(batch, n))
        return _Tree(
            self.tokens.gather(1, nodes),
            slot_of.gather(1, self.parents.gather(1, nodes)),
            self.depth.gather(1, nodes),
            self.visibility(nodes, nodes),
            self.score.gather(1, nodes),
        )


@dataclass
class _State:
    """The requests still running, slot i of every tensor is ``rids[i]``."""

    rids: list
    target: _KV
    draft: _KV | None
    # last step's emitted tokens (first pending_len per row): the draft has seen none of them, the
    # target all but the last one, which is the root of the next step
    pending: torch.Tensor  # [B, a]
    pending_len: torch.Tensor  # [B]
    n_out: torch.Tensor  # [B] completion tokens so far (CPU)
    # EAGLE3 head as draft: the target's aux states at the pending tokens' parents, [B, a, K * H]
    pending_aux: torch.Tensor | None = None

    @property
    def root(self) -> torch.Tensor:
        return self.pending.gather(1, (self.pending_len - 1)[:, None])[:, 0]  # [B]

    @property
    def free(self) -> list[int]:
        """Rows whose request finished (their id is None): a waiting request may take them."""
        return [i for i, rid in enumerate(self.rids) if rid is None]

    def without(self, rows: list[int]) -> "_State":
        """The state without batch rows ``rows``."""
        keep = torch.ones(len(self.rids), dtype=torch.bool)
        keep[rows] = False
        kept = keep.nonzero()[:, 0]  # CPU
        dev = kept.to(self.pending.device)
        for kv in (self.target, self.draft):
            if kv is not None:
                kv.select(dev)
        return _State(
            [self.rids[i] for i in kept.tolist()], self.target, self.draft,
            self.pending[dev], self.pending_len[dev], self.n_out[kept],
            None if self.pending_aux is None else self.pending_aux[dev],
        )

    def admit(self, new: "_State") -> "_State":
        """``new``'s requests take the free rows first, the rest are appended; free rows left over
        leave the batch. Only the new requests' slots are copied (a freed row is overwritten in place)."""
        holes = self.free
        h = min(len(holes), len(new.rids))
        dev = self.pending.device
        fill, src, rest = torch.tensor(holes[:h], dtype=torch.long), torch.arange(h), torch.arange(h, len(new.rids))
        for mine, theirs in ((self.target, new.target), (self.draft, new.draft)):
            if mine is not None:
                mine.put(fill.to(dev), theirs, src.to(dev))
                if rest.numel():
                    mine.extend(theirs, rest.to(dev))

        def merged(old, young, where):
            width = max(old.shape[1], young.shape[1]) if old.dim() > 1 else None
            old, young = (_widen(old, width), _widen(young, width)) if width else (old.clone(), young)
            i, j, k = (t.to(where) for t in (fill, src, rest))
            old[i] = young[j]
            return torch.cat([old, young[k]])

        rids = list(self.rids)
        for i, rid in zip(holes[:h], new.rids[:h]):
            rids[i] = rid
        state = _State(
            rids + new.rids[h:], self.target, self.draft,
            merged(self.pending, new.pending, dev), merged(self.pending_len, new.pending_len, dev),
            merged(self.n_out, new.n_out, "cpu"),
            None if self.pending_aux is None else merged(self.pending_aux, new.pending_aux, dev),
        )
        return state.without(holes[h:]) if len(holes) > h else state


def _widen(t: torch.Tensor, width: int) -> torch.Tensor:
    """``t [B, w, ...]`` zero-padded along dim 1 to ``width`` (a new tensor)."""
    pad = [0, 0] * (t.dim() - 2) + [0, width - t.shape[1]]
    return torch.nn.functional.pad(t, pad)


def _admissible(waiting: deque, free: int, max_tokens: int | None) -> list:
    """Pop the next requests to prefill together: at most ``free`` of them, and (after the first)
    only while the padded batch stays within ``max_tokens`` prompt tokens."""
    batch = [waiting.popleft()]
    width = batch[0][1].numel()
    while waiting and len(batch) < free:
        w = max(width, waiting[0][1].numel())
        if max_tokens is not None and w * (len(batch) + 1) > max_tokens:
            break
        batch.append(waiting.popleft())
        width = w
    return batch


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


def _pad(prompts: Sequence[torch.Tensor], side: str, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``ids [B, P]`` and ``valid [B, P]`` for prompts of different lengths."""
    width = max(p.numel() for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    valid = torch.zeros(len(prompts), width, dtype=torch.bool)
    for i, p in enumerate(prompts):
        cols = slice(0, p.numel()) if side == "right" else slice(width - p.numel(), width)
        ids[i, cols] = p
        valid[i, cols] = True
    return ids.to(device), valid.to(device)


def _prompt_block(valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions ``[B, P]`` (counted over real tokens only) and causal visibility ``[B, P, P]`` for a padded prompt."""
    positions = (valid.long().cumsum(1) - 1).clamp(min=0)
    width = valid.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool, device=valid.device).tril()
    return positions, causal[None] & valid[:, None, :]


class HFEngine:
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
    ):
        if padding_side not in ("left", "right"):
            raise HsxError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
        self.target = _Driven.of(model, "target model")
        self.model = self.target.model
        self.groups = list(groups)
        self.shape = ModelShape.from_config(model.config)
        self.device = next(model.parameters()).device
        self.store_dtype = store_dtype
        self.padding_side = padding_side
        self.stats = StreamStats()
        self.vocab_size = int(model.config.vocab_size)
        self.head = isinstance(draft_model, Eagle3Head)
        self.aux_sources: tuple[int, ...] = ()
        if self.head:
            # a one-layer head with its own attention: full attention over the slots the engine shows it
            self.draft = _Driven(draft_model.eval(), AttentionPlan({FULL: None}, False), None)
            self.aux_sources = head_aux_boundaries(draft_model, model)
        else:
            self.draft = None if draft_model is None else _Driven.of(draft_model, "draft model")
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

    # ---- public entry points -------------------------------------------------------------

    def prefill(self, requests: Sequence[tuple[object, torch.Tensor]]) -> list[AlignedSample]:
        """Teacher-forced rows for every position of each sequence, one batched forward."""
        rids, prompts = self._check_requests(requests)
        if not rids:
            return []
        ids, valid = _pad(prompts, self.padding_side, self.device)  # [B, P]
        positions, block = _prompt_block(valid)
        with torch.inference_mode(), _NormTap(self.target) as tap:
            out = _forward(self.target, ids, positions, positions, block, None, hidden=True,
                           **self.target.logits_at(1))  # rows only: the logits are not read
            cols = self._columns(out.hidden_states, tap)  # name -> [B, P, W]
            return [
                teacher_forced(prompts[i], {name: c[i][valid[i]] for name, c in cols.items()}, self.groups, self.store_dtype)
                for i in range(len(rids))
            ]

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
                    batch = _admissible(waiting, slots - busy, max_prefill_tokens)
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
                tree = self._draft_tree(state) if self.draft_model is not None else _Tree.start(state.root, 1)
                emitted, accept_lens, hidden, aux = self._verify(state, tree, sampling, generator)
                collector.step(state.rids, hidden, emitted, accept_lens, stride)
                state, finished = self._retire(state, emitted, accept_lens, sampling, collector, aux)
                yield from finished

    # ---- steps ---------------------------------------------------------------------------

    def _start(self, rids, prompts, collector, sampling, generator, capacity: int = 0) -> _State:
        """Prefill both models over the padded prompts; the target picks each request's first token.
        ``capacity`` is the cache slots per row to allocate ahead."""
        ids, valid = _pad(prompts, self.padding_side, self.device)  # [B, P]
        positions, block = _prompt_block(valid)
        target = _KV(self.target, len(rids), self.device, capacity)
        last = (valid.long() * torch.arange(valid.shape[1], device=self.device)).argmax(1)  # [B] last real slot
        # logits only at the rows' last positions (a few distinct ones), not [B, P, V]
        wanted, which = torch.unique(last, return_inverse=True) if self.target.slices_logits else (None, last)
        with _NormTap(self.target) as tap:
            out = target.run(ids, positions, block, hidden=True, **self.target.logits_at(wanted))
        target.commit(valid)
        last_logits = out.logits[torch.arange(len(rids), device=self.device), which]  # [B, V]
        first = _choose(last_logits, sampling, generator)  # [B]
        cols = self._columns(out.hidden_states, tap)
        first_list = first.tolist()
        for i, rid in enumerate(rids):
            collector.prefill(rid, prompts[i], {name: c[i][valid[i]] for name, c in cols.items()}, first_list[i])
        draft, pending_aux = None, None
        if self.head:
            # the head's slot t pairs token t+1 with the target's aux state after token t (SGLang's draft extend);
            # the last prompt position waits for the first token, as the pending step
            aux = self._cat(self.aux_sources, out.hidden_states, tap)  # [B, P, K * H]
            nxt_valid = valid & torch.cat([valid[:, 1:], valid[:, :1] & False], 1)
            nxt_ids = torch.cat([ids[:, 1:], ids[:, :1]], 1)
            draft = _KV(self.draft, len(rids), self.device, capacity)
            draft.run(nxt_ids, positions, block & nxt_valid[:, None, :], draft_hidden=aux)
            draft.commit(nxt_valid)
            pending_aux = aux[torch.arange(len(rids), device=self.device), last][:, None]  # [B, 1, K * H]
        elif self.draft_model is not None:
            draft = _KV(self.draft, len(rids), self.device, capacity)
            draft.run(ids, positions, block, **self.draft.logits_at(1))  # the catch-up gives the root's logits
            draft.commit(valid)
        ones = torch.ones(len(rids), dtype=torch.long, device=self.device)
        return _State(list(rids), target, draft, first[:, None], ones, torch.zeros(len(rids), dtype=torch.long),
                      pending_aux)

    def _draft_tree(self, state: _State) -> _Tree:
        """Draft ``num_draft_tokens - 1`` nodes per request: expand the top-k frontier for num_steps levels
        and keep the best nodes by cumulative draft log-prob (EAGLE / SGLang tree drafting)."""
        k, n = self.spec.topk, self.spec.num_draft_tokens
        draft = state.draft
        root_logits, root_hidden = self._draft_catch_up(state)  # [B, V], head: [B, H]
        root_pos = draft.lengths - 1  # [B]
        pool = _Tree.start(state.root, self.spec.pool_size)
        top = torch.log_softmax(root_logits.float(), -1).topk(k)  # [B, k]
        frontier = pool.add(1, top.indices, top.values, torch.zeros_like(top.indices), 1).expand(len(state.rids), k)
        # a head reads, with each frontier token, the output it produced at that token's parent
        hid = None if root_hidden is None else root_hidden[:, None].expand(-1, k, -1)  # [B, k, H]
        fed = frontier[:, :0]  # [B, f] pool nodes fed to the draft this step, in cache order
        start = 1 + k
        for level in range(2, self.spec.num_steps + 1):
            fed = torch.cat([fed, frontier], 1)
            positions = (root_pos[:, None] + level - 1).expand(-1, k)  # [B, k] the frontier sits at depth level - 1
            extra = {} if hid is None else {"draft_hidden": hid}
            out = draft.run(pool.tokens.gather(1, frontier), positions, pool.visibility(frontier, fed), **extra)
            child = torch.log_softmax(out.logits.float(), -1).topk(k)  # [B, k, k]
            child_score = pool.score.gather(1, frontier)[:, :, None] + child.values  # [B, k, k]
            parents = frontier[:, :, None].expand(-1, -1, k).flatten(1)  # [B, k * k]
            pool.add(start, child.indices.flatten(1), child_score.flatten(1), parents, level)
            best = child_score.flatten(1).topk(k).indices  # [B, k] best candidates go deeper
            frontier = start + best
            if hid is not None:
                hid = out.hidden.gather(1, (best // k)[:, :, None].expand(-1, -1, out.hidden.shape[2]))
            start += k * k
        if fed.shape[1]:
            draft.commit(torch.zeros_like(fed, dtype=torch.bool))  # forget the guesses; accepted ones come back as pending
        # keep the best n - 1 nodes. A child's score never exceeds its parent's and the stable sort ranks
        # earlier (shallower) pool entries first on ties, so the kept set contains its ancestors.
        best = torch.sort(pool.score[:, 1:], dim=1, descending=True, stable=True).indices[:, : n - 1] + 1
        root = torch.zeros_like(best[:, :1])
        return pool.subtree(torch.cat([root, best.sort(1).values], 1))  # [B, n] nodes in pool (depth) order

    def _draft_catch_up(self, state: _State) -> torch.Tensor:
        """Feed the draft what it has not seen (last step's emitted tokens, root last) as one block;
        returns its logits after the root ``[B, V]``."""
        draft, dev = state.draft, self.device
        q = state.pending.shape[1]
        pend_valid = torch.arange(q, device=dev)[None, :] < state.pending_len[:, None]  # [B, q]
        causal = torch.ones(q, q, dtype=torch.bool, device=dev).tril()
        positions = draft.lengths[:, None] + torch.arange(q, device=dev)  # [B, q]
        extra = {} if state.pending_aux is None else {"draft_hidden": state.pending_aux}
        out = draft.run(state.pending, positions, causal[None] & pend_valid[:, None, :], **extra)
        draft.commit(pend_valid)
        last = (torch.arange(len(state.rids), device=dev), state.pending_len - 1)
        return out.logits[last], (out.hidden[last] if self.head else None)

    def _verify(self, state: _State, tree: _Tree, sampling, generator):
        """One target forward over ``[root + drafts]``; returns emitted tokens ``[B, n]``, accept lengths
        ``[B]`` and rows ``{name: [B * n, W]}``, each request's accepted path at the front of its stride."""
        batch, n = tree.tokens.shape
        target = state.target
        positions = target.lengths[:, None] + tree.depth  # [B, n]
        with _NormTap(self.target) as tap:
            out = target.run(tree.tokens, positions, tree.anc, hidden=True)
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
        cols = self._columns(out.hidden_states, tap)  # name -> [B, n, W]
        hidden = {
            name: c.gather(1, path[:, :, None].expand(-1, -1, c.shape[2])).reshape(batch * n, -1)
            for name, c in cols.items()
        }
        target.commit(on_path)  # the target keeps exactly the root and the accepted drafts
        aux = None
        if self.head:  # the head's next catch-up reads the aux states along the accepted path
            aux = self._cat(self.aux_sources, out.hidden_states, tap)
            aux = aux.gather(1, path[:, :, None].expand(-1, -1, aux.shape[2]))
        return emitted, accept_lens, hidden, aux

    def _retire(self, state: _State, emitted, accept_lens, sampling, collector, aux=None) -> tuple[_State, list]:
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
        rids, out = list(state.rids), []
        for i in finished.nonzero()[:, 0].tolist():
            length, reason = (int(stop_len[i]), "stop") if has_stop[i] else (sampling.max_new_tokens, "length")
            out.append((rids[i], collector.finish(rids[i], length, reason, speculative=self.draft_model is not None)))
            rids[i] = None
        a_max = int(accept_cpu.max())
        state = _State(rids, state.target, state.draft, emitted[:, :a_max], accept_lens, n_out,
                       None if aux is None else aux[:, :a_max])
        return state, out

    # ---- helpers -------------------------------------------------------------------------

    def _columns(self, hidden_states, tap: _NormTap) -> dict[str, torch.Tensor]:
        """Each group's ``[B, q, W]``: its sources concatenated along the width in the order given."""
        num_layers = self.shape.num_layers
        if hidden_states is None or len(hidden_states) != num_layers + 1:
            got = None if hidden_states is None else len(hidden_states)
            raise HsxError(f"model returned {got} hidden-state entries, expected num_layers + 1 = {num_layers + 1}")

        return {g.name: self._cat(g.sources, hidden_states, tap) for g in self.groups}

    def _cat(self, sources, hidden_states, tap: _NormTap) -> torch.Tensor:
        """Boundaries ``sources`` concatenated along the width, ``[B, q, len(sources) * W]``."""
        num_layers = self.shape.num_layers

        def source(s):
            if s == FINAL:
                return tap.post  # lm_head's input (transformers' last entry, where it ties it to the norm output)
            return tap.pre if s == num_layers else hidden_states[s]

        return torch.cat([source(s) for s in sources], -1)

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
    """The target boundaries an EAGLE3 head reads, by SGLang's rule for its layer ids (id + 1 for Llama-style
    targets: the output of layer id; the model's default when the head names none)."""
    from hsx.engine.sglang import sglang_capture

    num_layers = int(target.config.get_text_config(decoder=True).num_hidden_layers)
    model_type = getattr(target.config, "model_type", None)
    bounds = sglang_capture(head.aux_ids, model_type, num_layers)
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
) -> HFEngine:
    """Load a target (and optional draft) with ``AutoModelForCausalLM`` and build an :class:`HFEngine`."""
    model = load_causal_lm(model_path, dtype, trust_remote_code, what="target model").to(device).eval()
    groups = parse_layers(layers, ModelShape.from_config(model.config), eagle3_ids) if isinstance(layers, str) else list(layers)
    draft = None if draft_path is None else load_draft(draft_path, model, dtype, trust_remote_code).to(device).eval()
    return HFEngine(model, groups, draft_model=draft, spec=spec, store_dtype=store_dtype, padding_side=padding_side)
