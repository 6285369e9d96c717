"""hsx.analysis on hand-made shards: token table rows and alignment, verify-step derivation, source
slices, PCA on known data, probes (planted signal, noise, leakage across a token split), statistics."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

import hsx
from hsx import analysis as A
from hsx.errors import HsxError
from hsx.shards import Manifest, Record, ShardSink, build_metadata

WIDTH = 6
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def write_dataset(path, samples: list[dict], mode: str = "generate", dtype: str = "float32",
                  max_shard_samples: int = 3):
    """Samples: dicts with ids, prompt_len, accept (or None), and per column a [rows, W] tensor."""
    layers = [{"name": "b1", "sources": [1], "width": WIDTH, "raw_ids": None, "rule": "test"},
              {"name": "eagle3", "sources": [1, 2, "final"], "width": 3 * WIDTH, "raw_ids": None, "rule": "test"}]
    meta = build_metadata(layers=layers, dtype=dtype, mode=mode, model={"path": "tiny", "model_type": "llama"},
                          engine={"name": "test", "version": "0"})
    sink = ShardSink(path, Manifest(meta), max_shard_samples=max_shard_samples)
    for i, s in enumerate(samples):
        n = len(s["ids"])
        sink.add(Record(sample_id=s.get("id", f"s{i}"), source_index=i, input_ids=torch.tensor(s["ids"]),
                        prompt_len=s["prompt_len"], loss_mask=(torch.arange(n) >= s["prompt_len"]).to(torch.uint8),
                        finish_reason="length", hidden={k: s[k].to(DTYPES[dtype]) for k in ("b1", "eagle3")},
                        accept_lens=None if s.get("accept") is None else torch.tensor(s["accept"], dtype=torch.int16)))
    sink.close()
    return hsx.open(path)


def tagged(i: int, rows: int, width: int) -> torch.Tensor:
    """Rows whose values name their sample, position and channel: 1000 i + 10 position + channel / 100."""
    return (1000.0 * i + 10.0 * torch.arange(rows)[:, None] + torch.arange(width)[None] / 100).float()


def tagged_samples(mode: str = "generate") -> list[dict]:
    # (tokens, prompt_len, accept_lens): consistent with the verify rule, some steps overshoot
    specs = [(5, 2, [1, 3]), (7, 3, [1, 3]), (3, 1, [2]), (6, 6, []), (8, 2, None), (4, 2, [1])]
    out = []
    for i, (n, prompt, accept) in enumerate(specs):
        rows = n - 1 if mode == "generate" else n
        out.append({"ids": list(range(10 * i, 10 * i + n)), "prompt_len": prompt, "accept": accept,
                    "b1": tagged(i, rows, WIDTH), "eagle3": tagged(i, rows, 3 * WIDTH)})
    return out


@pytest.fixture
def tagged_ds(tmp_path):
    return write_dataset(tmp_path / "tagged", tagged_samples())


# --- verify steps ----------------------------------------------------------------------------------

@pytest.mark.parametrize("prompt,n,accept,want", [
    # 7 completion tokens: token 0 from the prefill, then 2 + 3 + 1 (the last step overshot by 3)
    (3, 10, [2, 3, 4], [-2, -2, -2, -1, 0, 0, 1, 1, 1, 2]),
    (2, 6, [1, 1, 1], [-2, -2, -1, 0, 1, 2]),
    (1, 2, [5], [-2, -1]),  # one completion token: the step's tokens were all cut
    (4, 4, [], [-2] * 4),  # prefill-only sample
    (2, 5, None, [-2] * 5),  # no speculation
])
def test_accept_steps_by_hand(prompt, n, accept, want):
    assert A.accept_steps(prompt, n, accept).tolist() == want


def test_accept_steps_refuse_too_few_tokens():
    with pytest.raises(HsxError, match="sum to 2 for 6 decoded"):
        A.accept_steps(3, 10, [1, 1])


# --- token table and states ------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["generate", "prefill"])
def test_token_table_rows_and_columns(tmp_path, mode):
    samples = tagged_samples(mode)
    if mode == "prefill":
        for s in samples:
            s["prompt_len"], s["accept"] = len(s["ids"]), None
    ds = write_dataset(tmp_path / mode, samples, mode=mode)
    t = A.token_table(ds)
    rows = [s["b1"].shape[0] for s in samples]
    assert len(t) == sum(rows) == ds.tokens("b1").hidden.shape[0]
    for i, s in enumerate(samples):
        part = t[t["sample"] == i]
        ids = s["ids"]
        assert part["position"].tolist() == list(range(rows[i]))
        assert part["token_id"].tolist() == ids[:rows[i]]
        assert part["next_token_id"].tolist() == (ids[1:rows[i] + 1] + [-1] * (rows[i] + 1 - len(ids)))
        assert part["is_prompt"].tolist() == [p < s["prompt_len"] for p in range(rows[i])]
        assert part["loss_mask"].tolist() == [int(p >= s["prompt_len"]) for p in range(rows[i])]
        steps = A.accept_steps(s["prompt_len"], len(ids), s["accept"])[:rows[i]]
        got = part["accept_step"].fillna(A.NO_STEP).astype(int).tolist()
        assert got == steps.tolist()
        assert set(part["sample_id"]) == {f"s{i}"}


def test_prompt_rows_have_no_step(tagged_ds):
    t = A.token_table(tagged_ds)
    assert t.loc[t["is_prompt"], "accept_step"].isna().all()
    spec = t[~t["is_prompt"] & (t["sample"] != 4)]  # sample 4 has no speculation
    assert spec["accept_step"].notna().all()
    assert t.loc[t["sample"] == 4, "accept_step"].isna().all()


def test_states_follow_the_table_also_in_a_reordered_selection(tagged_ds):
    sel = tagged_ds.select(["s5", "s1", "s3", "s0"])
    for ds in (tagged_ds, sel):
        t = A.token_table(ds)
        x = A.states(ds, "eagle3")
        assert x.dtype == torch.float32 and x.shape == (len(t), 3 * WIDTH)
        want = torch.stack([ds[int(i)].hidden("eagle3")[int(p)] for i, p in zip(t["sample"], t["position"])]).float()
        assert torch.equal(x, want)
    t = A.token_table(sel)
    assert t["sample_id"].iloc[0] == "s5" and t["sample"].iloc[0] == 0


def test_split_sources_slices_each_boundary(tagged_ds):
    parts = A.split_sources(tagged_ds, "eagle3")
    assert [(p.source, p.start, p.stop, p.label) for p in parts] == [
        (1, 0, WIDTH, "b1"), (2, WIDTH, 2 * WIDTH, "b2"), ("final", 2 * WIDTH, 3 * WIDTH, "final")]
    whole = A.states(tagged_ds, "eagle3")
    assert torch.equal(A.states(tagged_ds, "eagle3", source=2), whole[:, WIDTH:2 * WIDTH])
    # boundary 1 is in both columns: listed once, from the first column that holds it
    assert [(s.column, s.label) for s in A.layer_sources(tagged_ds)] == [("b1", "b1"), ("eagle3", "b2"),
                                                                         ("eagle3", "final")]
    with pytest.raises(KeyError, match="no source 7"):
        A.states(tagged_ds, "eagle3", source=7)
    with pytest.raises(KeyError, match="no hidden-state column"):
        A.split_sources(tagged_ds, "b9")


def test_token_text_with_a_tokenizer(tagged_ds):
    class Words:
        def batch_decode(self, seqs):
            return [(" w" if i % 2 else "x") + str(i) for (i,) in seqs]

    t = A.token_table(tagged_ds, tokenizer=Words())
    assert (t["token"] == [(" w" if i % 2 else "x") + str(i) for i in t["token_id"]]).all()
    assert (t.loc[t["next_token_id"] < 0, "next_token"] == "").all()
    assert A.starts_with_space(t["next_token"]).tolist() == [i >= 0 and i % 2 == 1 for i in t["next_token_id"]]


def test_summary_counts(tagged_ds):
    s = A.summary(tagged_ds)
    samples = tagged_samples()
    assert s["samples"] == 6 and s["tokens"] == sum(len(x["ids"]) for x in samples)
    assert s["rows_per_column"] == sum(len(x["ids"]) - 1 for x in samples)
    assert s["completion_tokens"] == sum(len(x["ids"]) - x["prompt_len"] for x in samples)
    assert s["verify_steps"] == 6 and s["mean_accept_len"] == pytest.approx(11 / 6)
    assert list(s["layers"]["column"]) == ["b1", "eagle3"] and s["dtype"] == "float32"


# --- PCA -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("exact_up_to", [4096, 0])  # exact SVD and the randomised path
def test_pca_recovers_known_directions(exact_up_to):
    gen = torch.Generator().manual_seed(0)
    basis, _ = torch.linalg.qr(torch.randn(10, 10, generator=gen))
    scales = torch.tensor([5.0, 2.0] + [0.1] * 8)
    x = (torch.randn(4000, 10, generator=gen) * scales) @ basis.T + 3.0  # offset: PCA must centre
    p = A.pca(x, k=2, exact_up_to=exact_up_to)
    cos = (p.components @ basis[:, :2]).abs().diag()
    assert (cos > 0.999).all(), cos
    var = scales.pow(2)
    assert p.explained.tolist() == pytest.approx((var[:2] / var.sum()).tolist(), abs=0.01)
    assert torch.allclose(p.scores, (x - x.mean(0)) @ p.components.T, atol=1e-3)
    assert p.scores.mean(0).abs().max() < 1e-3


# --- probes ----------------------------------------------------------------------------------------

def grouped(n_groups: int, per: int, width: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n_groups * per, width, generator=gen)
    return x, np.repeat(np.arange(n_groups), per), gen


def test_probe_finds_a_planted_signal():
    x, groups, _ = grouped(40, 25, 16, seed=1)
    y = (x[:, 3] - 0.5 * x[:, 7] > 0).long().numpy()
    r = A.linear_probe(x, y, groups)
    assert r.accuracy > 0.9 and r.baseline < 0.7, r
    assert r.n_train + r.n_test == 1000 and r.test_groups == 10


def test_probe_does_not_beat_chance_on_noise():
    x, groups, gen = grouped(40, 25, 64, seed=2)
    y = torch.randint(0, 2, (1000,), generator=gen).numpy()
    r = A.linear_probe(x, y, groups)
    assert r.accuracy < 0.62 and abs(r.accuracy - r.baseline) < 0.12, r


def test_split_by_sample_prevents_leakage():
    # Each sample has its own fixed direction and one label for all its tokens: a token split lets
    # the probe recognise the sample; holding out whole samples leaves nothing to learn.
    gen = torch.Generator().manual_seed(3)
    n, per = 60, 20
    centres = torch.randn(n, 32, generator=gen) * 3
    x = centres.repeat_interleave(per, 0) + 0.1 * torch.randn(n * per, 32, generator=gen)
    y = np.repeat(torch.randint(0, 2, (n,), generator=gen).numpy(), per)
    by_sample = A.linear_probe(x, y, np.repeat(np.arange(n), per))
    by_token = A.linear_probe(x, y, np.arange(n * per))
    assert by_token.accuracy > 0.95
    assert by_sample.accuracy < 0.75, by_sample


def test_split_by_group_keeps_groups_whole():
    groups = np.repeat(np.arange(7), 3)
    test = A.split_by_group(groups, 0.3, seed=5)
    assert set(groups[test]).isdisjoint(groups[~test]) and test.any() and (~test).any()
    with pytest.raises(ValueError, match="at least 2 samples"):
        A.split_by_group(np.zeros(5, int))


def test_probe_layers_tells_layers_apart(tmp_path):
    # Label = sign of channel 0 of b2 (the eagle3 middle slice); b1 and final are independent noise.
    gen = torch.Generator().manual_seed(4)
    samples = []
    for i in range(30):
        n = 20
        b1 = torch.randn(n - 1, WIDTH, generator=gen)
        e3 = torch.randn(n - 1, 3 * WIDTH, generator=gen)
        samples.append({"ids": [i] * n, "prompt_len": 4, "accept": [1] * (n - 5), "b1": b1, "eagle3": e3})
    ds = write_dataset(tmp_path / "planted", samples, max_shard_samples=8)
    label = (A.states(ds, "eagle3", source=2)[:, 0] > 0).long().numpy()
    res = A.probe_layers(ds, label)
    acc = dict(zip(res["layer"], res["accuracy"]))
    base = dict(zip(res["layer"], res["baseline"]))
    assert list(res["layer"]) == ["b1", "b2", "final"]
    assert acc["b2"] > 0.95 and base["b2"] < 0.7
    assert acc["b1"] < 0.65 and acc["final"] < 0.65
    # a callable of the table and dropped rows (-1) work the same way
    res2 = A.probe_layers(ds, lambda t: np.where(t["is_prompt"], -1, label), columns=["eagle3"])
    assert list(res2["layer"]) == ["b1", "b2", "final"] and res2["n_train"].iloc[0] + res2["n_test"].iloc[0] == 30 * 15


# --- speculative and norm statistics ----------------------------------------------------------------

def test_accept_stats(tagged_ds):
    st = A.accept_stats(tagged_ds, bin_size=2)
    assert st.histogram.to_dict() == {1: 3, 2: 1, 3: 2}
    assert st.steps["accept_len"].sum() == 11 and len(st.steps) == 6
    s0 = st.steps[st.steps["sample_id"] == "s0"]
    # prompt 2, completion token 0 at position 2 from the prefill, step 0 emits position 3
    assert s0["position"].tolist() == [3, 4] and s0["completion_offset"].tolist() == [1, 2]
    assert s0["step"].tolist() == [0, 1]
    ps = st.per_sample.set_index("sample_id")
    assert "s4" not in ps.index  # no speculation
    assert ps.loc["s1", "mean_accept_len"] == 2.0 and ps.loc["s3", "steps"] == 0
    assert st.by_offset["steps"].tolist() == [4, 2]
    assert st.by_offset["mean_accept_len"].tolist() == pytest.approx([5 / 4, 3.0])


def test_norm_stats_find_a_massive_channel(tmp_path):
    gen = torch.Generator().manual_seed(5)
    samples = []
    for i in range(4):
        b1 = torch.randn(9, WIDTH, generator=gen)
        e3 = torch.randn(9, 3 * WIDTH, generator=gen)
        e3[:, WIDTH + 4] += 300.0  # boundary 2, channel 4
        samples.append({"ids": list(range(10)), "prompt_len": 3, "accept": None, "b1": b1, "eagle3": e3})
    ds = write_dataset(tmp_path / "massive", samples, dtype="bfloat16")
    ns = A.norm_stats(ds, top=2).set_index("layer")
    assert ns.loc["b2", "top_channels"][0] == 4
    assert ns.loc["b2", "max_over_median_channel"] > 50 and ns.loc["b1", "max_over_median_channel"] < 3
    x = A.states(ds, "b1")
    assert ns.loc["b1", "mean_norm"] == pytest.approx(x.norm(dim=1).mean().item(), rel=1e-5)
    assert ns.loc["b1", "max_abs"] == pytest.approx(x.abs().max().item())
    assert (ns["rows"] == 36).all()


def test_plots_draw(tagged_ds):
    import matplotlib

    matplotlib.use("Agg")
    t = A.token_table(tagged_ds)
    p = A.pca(A.states(tagged_ds, "b1"))
    A.plot_scatter(p.scores, t["position"], label="position")
    A.plot_scatter(p.scores, t["is_prompt"], categories={True: "prompt", False: "completion"})
    A.plot_accept(A.accept_stats(tagged_ds))
    A.plot_norms(A.norm_stats(tagged_ds))
    A.plot_probe(pd.DataFrame({"layer": ["b1", "b2"], "accuracy": [0.9, 0.8], "baseline": [0.5, 0.5],
                               "majority": [0.5, 0.5]}))
