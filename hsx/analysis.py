"""Analysis helpers for hsx shards: a per-token table, PCA, linear probes, speculative and norm statistics.

Everything works on an opened dataset (``ds = hsx.open(dir)``). The token table has one row per
covered token, in the same order as :func:`states`, so ``states(ds, name)[r]`` is the hidden state
of table row ``r`` (the state after consuming that row's token, the one that predicts the next).

Verify steps. In a speculative run the first completion token comes from the prefill; verify step
k then emits the next ``accept_lens[k]`` tokens (accepted drafts plus the target's own token), and
only the last step may emit more tokens than were kept (a stop token or the length limit cut it).
So completion token t >= 1 comes from the step k with ``sum(accept_lens[:k]) < t <=
sum(accept_lens[:k+1])``. ``accept_step`` is -1 for completion token 0 (:data:`PREFILL_STEP`) and
:data:`NO_STEP` for prompt tokens and for samples without accept lengths (decoded without
speculation, or by an engine that stores only the step count).

Maths runs in float32 (bfloat16 states are converted with ``.float()``); matplotlib is imported
only by the ``plot_*`` helpers.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import pandas as pd
import pyarrow.compute as pc
import torch

from hsx.errors import HsxError
from hsx.shards import format as fmt
from hsx.shards import positions

PREFILL_STEP = -1  # completion token 0: produced by the prefill forward
NO_STEP = -2  # prompt tokens, and completion tokens of samples without accept lengths
_CHUNK_ROWS = 1 << 16  # rows converted to float32 at a time by the streaming statistics
_SMALL_PROBE = 1 << 22  # feature values below which a probe is fitted on one thread


# --- per-sample arrays ----------------------------------------------------------------------------

@dataclass
class _Flat:
    """Base columns of every sample, flattened: ``ids[tok_start[i]:tok_start[i+1]]`` are sample i's tokens."""

    sample_id: list[str]
    ids: np.ndarray  # [T] int64
    loss_mask: np.ndarray  # [T] uint8
    prompt: np.ndarray  # [S] int64
    n_tok: np.ndarray  # [S] int64
    tok_start: np.ndarray  # [S + 1]
    accept_len: np.ndarray  # [S] int64, number of verify steps (0 without speculation)
    has_accept: np.ndarray  # [S] bool, accept_lens not null
    accept: np.ndarray  # [sum accept_len] int64, every step's accept length, samples in order
    rows: np.ndarray  # [S] hidden rows per sample
    row_owner: np.ndarray | None = None  # [R] sample of each stored row, samples in order
    row_pos: np.ndarray | None = None  # [R] its position (every covered one unless --keep chose fewer)
    image: np.ndarray | None = None  # [T] bool, image tokens (a vision-language output), else None


def _lengths(col) -> np.ndarray:
    return pc.fill_null(pc.list_value_length(col), 0).to_numpy().astype(np.int64)


def _flatten(col) -> np.ndarray:
    return pc.list_flatten(col).to_numpy().astype(np.int64)


def _flat(ds) -> _Flat:
    vision = bool(ds.metadata.get("vision"))
    t = ds.table(["sample_id", "input_ids", "prompt_len", "loss_mask", "accept_lens"] + (["image_mask"] if vision else []))
    n_tok = _lengths(t.column("input_ids"))
    prompt = t.column("prompt_len").to_numpy().astype(np.int64)
    loss_mask = _flatten(t.column("loss_mask")).astype(np.uint8)
    tok_start = np.concatenate([[0], np.cumsum(n_tok)])
    owner, pos = positions.kept(fmt.keep_of(ds.metadata), ds.metadata["mode"], n_tok, prompt, loss_mask, tok_start)
    return _Flat(
        sample_id=t.column("sample_id").to_pylist(),
        ids=_flatten(t.column("input_ids")),
        loss_mask=loss_mask,
        prompt=prompt,
        n_tok=n_tok,
        tok_start=tok_start,
        accept_len=_lengths(t.column("accept_lens")),
        has_accept=t.column("accept_lens").is_valid().to_numpy(zero_copy_only=False),
        accept=_flatten(t.column("accept_lens")),
        rows=np.bincount(owner, minlength=len(n_tok)).astype(np.int64),
        row_owner=owner,
        row_pos=pos,
        image=_flatten(t.column("image_mask")).astype(bool) if vision else None,
    )


def _steps_of_tokens(f: _Flat) -> np.ndarray:
    """[T] the verify step that produced each token (see the module docstring), vectorised over samples."""
    steps = np.full(f.ids.shape[0], NO_STEP, dtype=np.int64)
    spec = f.has_accept & (f.n_tok > f.prompt)
    steps[f.tok_start[:-1][spec] + f.prompt[spec]] = PREFILL_STEP
    decoded = np.maximum(f.n_tok - f.prompt - 1, 0)
    emitted = np.bincount(np.repeat(np.arange(len(f.n_tok)), f.accept_len), weights=f.accept, minlength=len(f.n_tok))
    short = np.flatnonzero(f.has_accept & (emitted < decoded))
    if short.size:
        j = int(short[0])
        raise HsxError(f"sample {f.sample_id[j]!r}: accept lengths sum to {int(emitted[j])} for {int(decoded[j])} "
                       f"decoded tokens ({short.size} such samples)")
    step_owner = np.repeat(np.arange(len(f.n_tok)), f.accept_len)  # [steps]
    tok_owner = np.repeat(step_owner, f.accept)  # [emitted tokens]
    tok_step = np.repeat(_index_in_group(f.accept_len), f.accept)
    within = _index_in_group(emitted.astype(np.int64))  # decoded token index t - 1
    keep = within < decoded[tok_owner]  # the last step's overshoot was cut
    pos = f.prompt[tok_owner[keep]] + 1 + within[keep]
    steps[f.tok_start[tok_owner[keep]] + pos] = tok_step[keep]
    return steps


def _index_in_group(counts: np.ndarray) -> np.ndarray:
    """[sum counts] 0..counts[g]-1 for each group g in turn."""
    return np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)


def _sum_before_in_group(values: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """[sum counts] for each value, the sum of the values before it in its group."""
    total = np.concatenate([[0], np.cumsum(values)])
    return total[:-1] - np.repeat(total[np.cumsum(counts) - counts], counts)


def accept_steps(prompt_len: int, num_tokens: int, accept_lens) -> np.ndarray:
    """[num_tokens] verify step that produced each token of one sample (-1 prefill, -2 none)."""
    a = np.asarray([] if accept_lens is None else accept_lens, dtype=np.int64)
    f = _Flat(sample_id=["sample"], ids=np.zeros(num_tokens, np.int64), loss_mask=np.zeros(num_tokens, np.uint8),
              prompt=np.array([prompt_len]), n_tok=np.array([num_tokens]), tok_start=np.array([0, num_tokens]),
              accept_len=np.array([a.size]), has_accept=np.array([accept_lens is not None]), accept=a,
              rows=np.array([num_tokens]))
    return _steps_of_tokens(f)


def _row_index(f: _Flat) -> tuple[np.ndarray, np.ndarray]:
    """(owner sample, position) of every hidden row, samples in dataset order."""
    return f.row_owner, f.row_pos


# --- the token table and the states that go with it ---------------------------------------------

def token_table(ds, tokenizer=None) -> pd.DataFrame:
    """One row per covered token (per hidden row), in :func:`states` order.

    Columns: ``sample`` (index in ``ds``), ``sample_id``, ``position``, ``token_id``, ``next_token_id``
    (the token the row's state predicts; -1 after the last token), ``is_prompt``, ``loss_mask``,
    ``accept_step`` (module docstring; <NA> for prompt tokens and samples without accept lengths),
    ``is_image`` on a vision-language output (the row's token is an image token), and with a
    tokenizer ``token`` and ``next_token`` (decoded text of each single token).
    """
    f = _flat(ds)
    owner, pos = _row_index(f)
    at = f.tok_start[owner] + pos
    has_next = pos + 1 < f.n_tok[owner]
    next_id = np.where(has_next, f.ids[np.minimum(at + 1, f.ids.size - 1)], -1)
    step = pd.array(_steps_of_tokens(f)[at], dtype="Int64")
    step[step == NO_STEP] = pd.NA
    codes, names = pd.factorize(pd.Series(f.sample_id, dtype=object))
    df = pd.DataFrame({
        "sample": owner,
        "sample_id": pd.Categorical.from_codes(codes[owner], categories=names),
        "position": pos,
        "token_id": f.ids[at],
        "next_token_id": next_id,
        "is_prompt": pos < f.prompt[owner],
        "loss_mask": f.loss_mask[at],
        "accept_step": step,
    })
    if f.image is not None:
        df["is_image"] = f.image[at]
    if tokenizer is not None:
        text = token_texts(tokenizer, np.concatenate([df["token_id"].to_numpy(), next_id]))
        df["token"] = df["token_id"].map(text)
        df["next_token"] = df["next_token_id"].map(text)
    return df


def token_split(ds, table: pd.DataFrame) -> tuple[pd.Series, str]:
    """The two kinds of token a plot should tell apart, per token table row, and their title.

    generate mode: ``prompt`` / ``completion``. prefill mode has no completion (every token is
    prompt), so it splits by ``loss_mask`` instead: ``assistant`` (tokens learned from) / ``context``.
    On a vision-language output image tokens are a third kind, ``image``.
    """
    if ds.metadata["mode"] == "prefill":
        kinds = table["loss_mask"].astype(bool).map({True: "assistant", False: "context"})
        title = "assistant vs context (loss_mask)"
    else:
        kinds, title = table["is_prompt"].map({True: "prompt", False: "completion"}), "prompt vs completion"
    if "is_image" in table:
        kinds, title = kinds.where(~table["is_image"], "image"), title + " vs image"
    return kinds, title


def token_texts(tokenizer, ids) -> dict[int, str]:
    """Decoded text of each distinct token id (one tokenizer call); -1 maps to ''."""
    uniq = [int(i) for i in np.unique(np.asarray(ids)) if i >= 0]
    return {-1: "", **dict(zip(uniq, tokenizer.batch_decode([[i] for i in uniq])))}


def load_tokenizer(ds):
    """The run's tokenizer when its directory is on this machine, else None (analyse token ids only);
    see :meth:`hsx.shards.reader.ShardDataset.tokenizer`."""
    from hsx.errors import HsxError

    try:
        return ds.tokenizer()
    except HsxError:
        return None


def starts_with_space(texts: pd.Series) -> pd.Series:
    """True where a decoded token begins with whitespace (it starts a new word in most tokenizers)."""
    return texts.str.match(r"\s").fillna(False).astype(bool)


@dataclass(frozen=True)
class LayerSlice:
    """Source ``source`` (a boundary number or ``"final"``) is ``column[:, start:stop]``."""

    column: str
    source: int | str
    start: int
    stop: int

    @property
    def label(self) -> str:
        return "final" if self.source == "final" else f"b{self.source}"


def split_sources(ds, name: str) -> list[LayerSlice]:
    """The sources a column concatenates (``eagle3``: three boundaries), as width slices."""
    group = next((g for g in ds.metadata["layers"] if g["name"] == name), None)
    if group is None:
        raise KeyError(f"no hidden-state column {name!r}; columns: {ds.columns}")
    width = group["width"] // len(group["sources"])
    return [LayerSlice(name, s, k * width, (k + 1) * width) for k, s in enumerate(group["sources"])]


def layer_sources(ds, columns=None) -> list[LayerSlice]:
    """One slice per distinct source over ``columns`` (default all), boundaries in order, ``final`` last."""
    seen: dict = {}
    for name in columns or ds.columns:
        for sl in split_sources(ds, name):
            seen.setdefault(sl.source, sl)
    return sorted(seen.values(), key=lambda sl: (sl.source == "final", sl.source if sl.source != "final" else 0))


def states(ds, name: str, source=None) -> torch.Tensor:
    """[R, W] float32 states of column ``name`` (or one of its sources), row r = token table row r."""
    tm = ds.tokens(name)
    owner, pos = _row_index(_flat(ds))  # token table order: samples in dataset order, positions ascending
    stride = int(pos.max()) + 1 if pos.size else 1
    order = owner * stride + pos
    key = torch.from_numpy(np.searchsorted(order, tm.sample_index.numpy() * stride + tm.position.numpy()))
    h = tm.hidden
    if source is not None:
        sl = next((s for s in split_sources(ds, name) if s.source == source), None)
        if sl is None:
            raise KeyError(f"column {name!r} has no source {source!r}; sources: {[s.source for s in split_sources(ds, name)]}")
        h = h[:, sl.start:sl.stop]
    if not torch.equal(key, torch.arange(key.numel())):  # a reordered selection: put rows in table order
        out = torch.empty_like(h)
        out[key] = h
        h = out
    return h.to(torch.float32, copy=True)  # a writable copy, also when the stored dtype is float32


# --- summary --------------------------------------------------------------------------------------

def summary(ds) -> dict:
    """Counts and provenance: samples, tokens, rows, layers with their sources, dtype, model, engine."""
    f, meta = _flat(ds), ds.metadata
    out = {
        "samples": len(ds),
        "tokens": int(f.n_tok.sum()),
        "prompt_tokens": int(f.prompt.sum()),
        "completion_tokens": int((f.n_tok - f.prompt).sum()),
        "rows_per_column": int(f.rows.sum()),
        "mode": meta["mode"],
        "dtype": meta["dtype"],
        "model": meta.get("model", {}).get("path"),
        "model_type": meta.get("model", {}).get("model_type"),
        "engine": " ".join(str(meta.get("engine", {}).get(k, "")) for k in ("name", "version")).strip(),
        "speculative": meta.get("speculative"),
        "layers": pd.DataFrame([{"column": g["name"], "sources": g["sources"], "width": g["width"],
                                 "rule": g.get("rule")} for g in meta["layers"]]),
    }
    if f.accept.size:
        out["verify_steps"] = int(f.accept.size)
        out["mean_accept_len"] = float(f.accept.mean())
    return out


# --- PCA and linear probes -------------------------------------------------------------------------

@dataclass
class PCA:
    scores: torch.Tensor  # [R, k] projections of the centred data
    components: torch.Tensor  # [k, W] unit directions, largest variance first
    explained: torch.Tensor  # [k] fraction of the total variance along each component
    mean: torch.Tensor  # [W]


def pca(x: torch.Tensor, k: int = 2, exact_up_to: int = 4096) -> PCA:
    """Principal components of the rows of ``x`` (centred). Exact SVD while the smaller side of ``x`` is
    at most ``exact_up_to``, randomised (``torch.pca_lowrank``) above. Signs are fixed so that each
    component's largest loading is positive."""
    x = x.float()
    mean = x.mean(dim=0)
    xc = x - mean  # [R, W]
    if min(xc.shape) <= exact_up_to:
        _, s, vh = torch.linalg.svd(xc, full_matrices=False)
        comps, s = vh[:k], s[:k]
    else:
        _, s, v = torch.pca_lowrank(xc, q=min(k + 8, min(xc.shape)), center=False, niter=4)
        comps, s = v[:, :k].T, s[:k]
    sign = torch.sign(comps.gather(1, comps.abs().argmax(dim=1, keepdim=True)))
    comps = comps * sign
    total = xc.pow(2).sum().clamp_min(1e-30)
    return PCA(scores=xc @ comps.T, components=comps, explained=s.pow(2) / total, mean=mean)


@dataclass
class ProbeResult:
    accuracy: float  # held-out accuracy with the true labels
    baseline: float  # held-out accuracy of the same probe trained on shuffled labels
    majority: float  # held-out accuracy of always predicting the training majority class
    n_train: int
    n_test: int
    test_groups: int  # held-out samples


@contextmanager
def _torch_threads(n: int):
    """Run with ``n`` torch threads, then restore. On small problems the thread pool's hand-offs cost
    more than the work, and they stall outright when another process holds one of the cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _fit_logreg(x: torch.Tensor, y: torch.Tensor, classes: int, l2: float, max_iter: int):
    w = torch.zeros(x.shape[1], classes, requires_grad=True)
    b = torch.zeros(classes, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], lr=1.0, max_iter=max_iter, history_size=10, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(x @ w + b, y) + l2 * w.pow(2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return w.detach(), b.detach()


def split_by_group(groups, test_frac: float = 0.25, seed: int = 0) -> np.ndarray:
    """[R] bool test mask holding out whole groups (samples), so no sample is on both sides."""
    groups = np.asarray(groups)
    uniq = np.unique(groups)
    if uniq.size < 2:
        raise ValueError(f"a split by sample needs at least 2 samples, got {uniq.size}")
    n_test = min(max(1, round(test_frac * uniq.size)), uniq.size - 1)
    held = np.random.default_rng(seed).permutation(uniq)[:n_test]
    return np.isin(groups, held)


def linear_probe(x, y, groups, *, test_frac: float = 0.25, l2: float = 1e-3, max_iter: int = 100,
                 seed: int = 0) -> ProbeResult:
    """Logistic-regression probe from rows ``x`` [R, W] to integer labels ``y`` [R], held out by ``groups``.

    Whole samples go to the test side (tokens of one sample are correlated: a split by token leaks).
    Features are standardised with the training statistics. The baseline is the same probe trained
    on a permutation of the training labels and scored on the true test labels.
    """
    x = torch.as_tensor(x).float()
    y = torch.from_numpy(np.array(y, dtype=np.int64))
    if x.shape[0] != y.shape[0] or len(groups) != y.shape[0]:
        raise ValueError(f"x has {x.shape[0]} rows, y {y.shape[0]}, groups {len(groups)}")
    test = torch.from_numpy(split_by_group(groups, test_frac, seed))
    xtr, ytr, xte, yte = x[~test], y[~test], x[test], y[test]
    mu, sd = xtr.mean(dim=0), xtr.std(dim=0).clamp_min(1e-6)
    xtr, xte = (xtr - mu) / sd, (xte - mu) / sd
    classes = int(y.max()) + 1 if y.numel() else 1
    gen = torch.Generator().manual_seed(seed)

    def score(labels):
        with _torch_threads(1 if x.numel() < _SMALL_PROBE else torch.get_num_threads()):
            w, b = _fit_logreg(xtr, labels, classes, l2, max_iter)
        return ((xte @ w + b).argmax(dim=1) == yte).float().mean().item()

    majority = torch.bincount(ytr, minlength=classes).argmax()
    return ProbeResult(
        accuracy=score(ytr),
        baseline=score(ytr[torch.randperm(ytr.numel(), generator=gen)]),
        majority=(yte == majority).float().mean().item(),
        n_train=int(ytr.numel()),
        n_test=int(yte.numel()),
        test_groups=int(np.unique(np.asarray(groups)[test.numpy()]).size),
    )


def probe_layers(ds, labels, columns=None, table: pd.DataFrame | None = None, **probe_kw) -> pd.DataFrame:
    """:func:`linear_probe` on every source (each boundary of a concatenated column separately).

    ``labels``: integer labels per token-table row (array or Series; negative = leave the row out),
    or a function of the token table returning them. Returns one row per layer.
    """
    table = token_table(ds) if table is None else table
    y = np.asarray(labels(table) if callable(labels) else labels).astype(np.int64)
    if y.shape[0] != len(table):
        raise ValueError(f"{y.shape[0]} labels for {len(table)} token rows")
    keep = y >= 0
    groups = table["sample"].to_numpy()[keep]
    out = []
    for sl in layer_sources(ds, columns):
        r = linear_probe(states(ds, sl.column, sl.source)[torch.from_numpy(keep)], y[keep], groups, **probe_kw)
        out.append({"layer": sl.label, "column": sl.column, **r.__dict__})
    return pd.DataFrame(out)


# --- speculative decoding and norms ----------------------------------------------------------------

@dataclass
class AcceptStats:
    steps: pd.DataFrame  # one row per verify step: sample, sample_id, step, position, completion_offset, accept_len
    histogram: pd.Series  # accept length -> number of steps
    per_sample: pd.DataFrame  # sample_id, steps, mean_accept_len, completion_tokens
    by_offset: pd.DataFrame  # completion-offset bin -> mean accept length, steps


def accept_stats(ds, bin_size: int = 8) -> AcceptStats:
    """Accept lengths per verify step, their histogram, per-sample means and their trend along the completion.

    A step's ``position`` is that of the first token it emitted; ``completion_offset`` is the same
    counted from the first completion token (which the prefill produced, so steps start at 1).
    """
    f = _flat(ds)
    owner = np.repeat(np.arange(len(f.n_tok)), f.accept_len)  # [steps]
    step = _index_in_group(f.accept_len)
    offset = 1 + _sum_before_in_group(f.accept, f.accept_len)  # completion index of the step's first token
    steps = pd.DataFrame({"sample": owner, "sample_id": np.asarray(f.sample_id, dtype=object)[owner], "step": step,
                          "position": f.prompt[owner] + offset, "completion_offset": offset, "accept_len": f.accept})
    spec = f.has_accept
    per_sample = pd.DataFrame({
        "sample_id": np.asarray(f.sample_id, dtype=object)[spec],
        "steps": f.accept_len[spec],
        "mean_accept_len": np.bincount(owner, weights=f.accept, minlength=len(f.n_tok))[spec] / np.maximum(f.accept_len[spec], 1),
        "completion_tokens": (f.n_tok - f.prompt)[spec],
    })
    by = steps.groupby(steps["completion_offset"] // bin_size * bin_size)["accept_len"]
    by_offset = pd.DataFrame({"mean_accept_len": by.mean(), "steps": by.size()}).rename_axis("completion_offset")
    return AcceptStats(steps, steps["accept_len"].value_counts().sort_index().rename_axis("accept_len"),
                       per_sample, by_offset)


def norm_stats(ds, columns=None, top: int = 4) -> pd.DataFrame:
    """Per source: mean and max L2 norm of the rows, mean and max |activation|, and the channels with
    the largest max |activation|. Massive activations (a few channels far larger than the rest) show
    as a large ``max_over_median_channel``: the largest channel max over the median channel max."""
    out = []
    for sl in layer_sources(ds, columns):
        h = ds.tokens(sl.column).hidden[:, sl.start:sl.stop]  # [R, W] stored dtype
        rows, width = h.shape
        norm_sum, norm_max, abs_sum = 0.0, 0.0, 0.0
        chan_max = torch.zeros(width)
        for i in range(0, rows, _CHUNK_ROWS):
            x = h[i:i + _CHUNK_ROWS].float()
            n = x.norm(dim=1)
            norm_sum += n.double().sum().item()
            norm_max = max(norm_max, n.max().item())
            a = x.abs()
            abs_sum += a.double().sum().item()
            chan_max = torch.maximum(chan_max, a.amax(dim=0))
        vals, idx = chan_max.topk(min(top, width))
        mean_abs = abs_sum / max(1, rows * width)
        out.append({"layer": sl.label, "column": sl.column, "rows": rows, "mean_norm": norm_sum / max(1, rows),
                    "max_norm": norm_max, "mean_abs": mean_abs, "max_abs": chan_max.max().item() if width else 0.0,
                    "max_over_median_channel": (chan_max.max() / chan_max.median().clamp_min(1e-30)).item()
                    if width else float("nan"),
                    "top_channels": idx.tolist(), "top_channel_max": [round(v, 3) for v in vals.tolist()]})
    return pd.DataFrame(out)


# --- plots -----------------------------------------------------------------------------------------

def _axes(ax, **kw):
    import matplotlib.pyplot as plt

    return (plt.subplots(**kw)[1] if ax is None else ax)


def plot_scatter(scores: torch.Tensor, color, ax=None, title: str = "", label: str = "", categories=None):
    """2-D scatter of ``scores[:, :2]``, coloured by a numeric array or, with ``categories``
    (value -> legend name), by class."""
    ax = _axes(ax, figsize=(5, 4))
    xy = scores[:, :2].numpy()
    color = np.asarray(color)
    if categories is None:
        art = ax.scatter(xy[:, 0], xy[:, 1], c=color, s=4, cmap="viridis", alpha=0.7)
        ax.figure.colorbar(art, ax=ax, label=label)
    else:
        for value, name in categories.items():
            m = color == value
            ax.scatter(xy[m, 0], xy[m, 1], s=4, alpha=0.7, label=name)
        ax.legend(markerscale=3, title=label or None)
    ax.set(title=title, xlabel="PC 1", ylabel="PC 2")
    return ax


def plot_probe(result: pd.DataFrame, ax=None, title: str = ""):
    """Held-out probe accuracy per layer with the shuffled-label baseline and the majority class."""
    ax = _axes(ax, figsize=(6, 3.5))
    x = np.arange(len(result))
    ax.plot(x, result["accuracy"], "o-", label="probe")
    ax.plot(x, result["baseline"], "s--", label="shuffled labels")
    ax.plot(x, result["majority"], ":", color="grey", label="majority class")
    ax.set_xticks(x, result["layer"])
    ax.set(title=title, xlabel="layer", ylabel="held-out accuracy", ylim=(0, 1.02))
    ax.legend()
    return ax


def plot_accept(stats: AcceptStats):
    """Histogram of accept lengths, mean accept length per sample, and accept length along the completion."""
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(13, 3.5))
    a.bar(stats.histogram.index, stats.histogram.to_numpy())
    a.set_xticks(stats.histogram.index)
    a.set(title="accept length per verify step", xlabel="tokens emitted", ylabel="steps")
    b.hist(stats.per_sample["mean_accept_len"], bins=20)
    b.set(title="mean accept length per sample", xlabel="tokens per step", ylabel="samples")
    c.scatter(stats.steps["completion_offset"], stats.steps["accept_len"], s=4, alpha=0.3)
    c.plot(stats.by_offset.index, stats.by_offset["mean_accept_len"], "o-", color="C1", label="bin mean")
    c.set(title="accept length along the completion", xlabel="completion offset of the step's first token",
          ylabel="tokens emitted")
    c.legend()
    fig.tight_layout()
    return fig


def plot_norms(norms: pd.DataFrame):
    """Mean and max row norm, and the massive-activation ratio, per layer."""
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.5))
    x = np.arange(len(norms))
    a.plot(x, norms["mean_norm"], "o-", label="mean")
    a.plot(x, norms["max_norm"], "s--", label="max")
    a.set_xticks(x, norms["layer"])
    a.set(title="L2 norm of the hidden state", xlabel="layer", yscale="log")
    a.legend()
    b.bar(x, norms["max_over_median_channel"])
    b.set_xticks(x, norms["layer"])
    b.set(title="largest channel max |x| / median channel max |x|", xlabel="layer", yscale="log")
    fig.tight_layout()
    return fig
