"""Every Python block of docs/*.md runs, in a folder laid out as the docs assume, and what it reads from
shards is compared with ``hsx.open``: a snippet that returns other rows fails here. The folder holds
``demo_out/`` (tiny demo models and default, ``planes-zstd`` shards of ``scripts/demo_run.toml`` over its 40
prompts, in several shards and writer lanes), ``my_model``, ``my_draft`` and ``my_data.jsonl``.

A block is either checked (``CHECKS``, keyed by its file and first line) or listed in ``NOT_RUN`` with
the reason; a block in neither fails the test, and a block listed as not run may not read shards."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import hsx
from hsx.config import ExtractConfig
from hsx.demo.models import build_tiny_llama, make_layerskip_draft
from hsx.demo.tokenizer import build_demo_tokenizer
from hsx.run.pipeline import extract
from shard_fixtures import bits

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))
DEMO_RUN = ROOT / "scripts" / "demo_run.toml"
PROMPTS = ROOT / "hsx" / "demo_data" / "prompts.jsonl"
SHARDS = "demo_out/shards"
READS_SHARDS = re.compile(r"hsx\.open|read_parquet|tokens_loader|Eagle3Dataset|load_dataset|pyarrow|hsx\.decode|frombuffer")

# (file, first line of the block past its imports) -> why it is not run here
NOT_RUN = {
    ("CONSUMERS.md", 'store = ActivationsStore(model=None, dataset=None, ..., hook_name="blocks.5.hook_resid_pre",'):
        "SAELens' own call with placeholders; run for real by scripts/consumers_check.sh in CI",
    ("STREAM.md", 'stream = Eagle3Stream("run.toml", "draft/config.json", max_len=2048, ahead=64)'):
        "an EAGLE3 stream from a user's run.toml and draft config; tests/test_stream.py runs Eagle3Stream",
    ("STREAM.md", 'feed = hsx.stream(dict(model=..., dataset=..., layers="final,eagle3", ray=True, num_workers=4,'):
        "a Ray cluster's config with placeholders; tests/test_stream.py runs the feed on a local Ray",
    ("STREAM.md", 'feed = hsx.stream("run.toml", remainder="drop")'):
        "one rank of a torchrun job on a Ray cluster; tests/test_stream_ranks.py runs two ranks under torchrun",
}


def first_line(body: str) -> str:
    """A block's key: its first line that is not an import, without its comment."""
    line = next(x for x in body.splitlines() if x.strip() and not re.match(r"(import|from \S+ import) ", x))
    return line.split("  #")[0].rstrip()


def python_blocks(page: Path) -> list[tuple[str, str, int]]:
    """(key, body, line number) of each fenced Python block of ``page``."""
    text = page.read_text()
    return [(first_line(m.group(1)), m.group(1), text.count("\n", 0, m.start()) + 2)
            for m in re.finditer(r"^```python\n(.*?)^```[ \t]*$", text, re.M | re.S)]


def all_blocks() -> list[tuple[str, str, str, int]]:
    return [(page.name, first, body, line) for page in DOCS for first, body, line in python_blocks(page)]


# --------------------------------------------------------------------------- the checks, against hsx.open


def _same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert tuple(a.shape) == tuple(b.shape), f"{what}: shape {tuple(a.shape)}, hsx.open gives {tuple(b.shape)}"
    assert torch.equal(bits(a), bits(b)), f"{what}: values differ from hsx.open's"


def check_open(ns: dict, ds) -> None:
    _same(ns["h"], ds[0].hidden("final"), "s.hidden('final')")
    assert ns["s"].sample_id == ds.sample_ids[0] == json.loads(PROMPTS.read_text().splitlines()[0])["id"]
    _same(ns["m"].hidden, torch.cat([s.hidden("eagle3") for s in ds]), "ds.tokens('eagle3').hidden")
    assert ns["sub"].sample_ids == ["msg-greet", "txt-tea"]


def check_pandas_cell(ns: dict, ds) -> None:
    assert list(ns["df"]["sample_id"]) == ds.sample_ids, "pandas lists the samples in another order than ds"
    _same(ns["h"], ds[0].hidden("final"), "the decoded pandas cell")


def check_loader(ns: dict, ds) -> None:
    batch = ns["batch"]  # the loop's last batch
    assert batch["final"].shape[0] > 0
    for x, i, p, t in zip(batch["final"], batch["sample_index"], batch["position"], batch["token_id"]):
        s = ds[int(i)]
        row = int(np.flatnonzero(s.positions.numpy() == int(p))[0])
        _same(x, s.hidden("final")[row], f"loader row of sample {int(i)} at position {int(p)}")
        assert int(t) == int(s.input_ids[int(p)])
        assert int(p) >= s.prompt_len - 1  # where="completion": the rows whose next token is a completion token


def check_plain_readers(ns: dict, ds) -> None:
    ids = ds.sample_ids
    assert list(ns["df"]["sample_id"]) == ids, "pandas: not in dataset order"
    assert ns["table"].column("sample_id").to_pylist() == ids, "pyarrow.dataset: not in dataset order"
    assert ns["rows"]["sample_id"] == ids, "datasets: not in dataset order"
    meta = ds.metadata
    width = {g["name"]: g["width"] for g in meta["layers"]}
    for k in (0, len(ds) - 1):
        for cell in (ns["df"]["eagle3"][k], ns["table"].column("eagle3")[k].as_py(), ns["rows"][k]["eagle3"]):
            a = hsx.decode(cell, width["eagle3"], meta["dtype"], meta["codec"])
            _same(torch.from_numpy(a).view(torch.bfloat16), ds[k].hidden("eagle3"), f"eagle3 cell of sample {k}")


def check_eagle3(ns: dict, _ds) -> None:
    ds = hsx.open("out/shards")
    batch = ns["batch"]
    for b in range(2):
        n = int(batch["attention_mask"][b].sum())
        _same(batch["aux_hidden_state"][b, :n], ds[b].hidden("eagle3")[:n], f"aux_hidden_state of sample {b}")
        _same(batch["target_hidden_state"][b, :n - 1], ds[b].hidden("final")[1:n], f"target_hidden_state of sample {b}")
        assert torch.equal(batch["input_ids"][b, :n - 1], ds[b].input_ids[1:n].long())


def check_options(ns: dict, _ds) -> None:
    out = hsx.open("out/run1")
    assert ns["summary"].samples == len(out) and ns["summary"].errors == 0
    assert out.columns == ["final", "eagle3"]


def check_stream(ns: dict, ds) -> None:
    item = ns["item"]  # the loop's last item: the stream gives the bits extract stored
    stored = ds[item.sample_id]
    assert torch.equal(item.input_ids.long(), stored.input_ids.long())
    for name in ds.columns:
        _same(item.hidden[name], stored.hidden(name), f"stream item {item.sample_id}, column {name}")
    assert ns["feed"].summary.samples == len(ds)


def check_token_text(ns: dict, ds) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained("demo_out/models/target")  # the run's tokenizer, loaded by hand
    assert ns["text"] == tok.decode(ds[0].input_ids)
    table = ns["table"]
    assert len(table) == ds.tokens("final").hidden.shape[0]
    first = table.iloc[1]
    assert first["next_token"] == tok.decode([int(ds[int(first["sample"])].input_ids[int(first["position"]) + 1])])


def check_probe(ns: dict, ds) -> None:
    from hsx import analysis as A

    assert Path("probe.png").stat().st_size > 1000  # written where the script ran
    table, labels, probe = ns["table"], ns["labels"], ns["probe"]
    keep = np.asarray(labels) >= 0
    groups = table["sample"].to_numpy()[keep]
    assert list(probe["layer"]) == ["b0", "b2", "b4", "b5", "b8", "final"]
    for (_, row), sl in zip(probe.iterrows(), A.layer_sources(ds)):
        x = torch.cat([s.hidden(sl.column) for s in ds]).float()[:, sl.start:sl.stop]  # the rows, from hsx.open
        mine = A.linear_probe(x[torch.from_numpy(keep)], np.asarray(labels)[keep].astype(np.int64), groups)
        assert row["accuracy"] == pytest.approx(mine.accuracy) and row["baseline"] == pytest.approx(mine.baseline)


CHECKS = {
    ("ANALYSIS.md", 'ds = hsx.open("demo_out/shards")'): check_token_text,
    ("ANALYSIS.md", 'matplotlib.use("Agg")'): check_probe,
    ("READING.md", 'ds = hsx.open("demo_out/shards")'): check_open,
    ("READING.md", 'df = pd.read_parquet("demo_out/shards")'): check_pandas_cell,
    ("READING.md", 'loader = hsx.tokens_loader("demo_out/shards", columns=["final"], where="completion",'): check_loader,
    ("FORMAT.md", 'df = pd.read_parquet("demo_out/shards")'): check_plain_readers,
    ("EAGLE3.md", 'ds = Eagle3Dataset("out/shards", draft_config="my_draft/config.json")'): check_eagle3,
    ("OPTIONS.md", 'summary = extract(ExtractConfig(model="my_model", dataset="my_data.jsonl", output="out/run1", '
                   'layers="final,eagle3"))'): check_options,
    ("STREAM.md", 'feed = hsx.stream("scripts/demo_run.toml", ahead=64, progress=True)'): check_stream,
}


# --------------------------------------------------------------------------- the folder


def _save(model, tok, path: Path) -> None:
    model.save_pretrained(path)
    tok.save_pretrained(path)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("docs")
    tok = build_demo_tokenizer()
    target = build_tiny_llama(num_layers=8, hidden_size=64, vocab_size=len(tok), seed=1, bos_token_id=tok.bos_token_id,
                              eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    draft = make_layerskip_draft(target, num_layers=2)
    for name, model in (("demo_out/models/target", target), ("demo_out/models/draft", draft), ("my_model", target)):
        _save(model, tok, root / name)
    (root / "my_draft").mkdir()
    (root / "my_draft" / "config.json").write_text(json.dumps({"hidden_size": 64, "vocab_size": len(tok)}))
    (root / "hsx" / "demo_data").mkdir(parents=True)
    shutil.copy(PROMPTS, root / "hsx" / "demo_data" / "prompts.jsonl")
    (root / "my_data.jsonl").write_text("\n".join(PROMPTS.read_text().splitlines()[:4]) + "\n")
    (root / "scripts").mkdir()
    shutil.copy(DEMO_RUN, root / "scripts" / "demo_run.toml")
    cwd = os.getcwd()
    os.chdir(root)
    try:  # the demo's run (small shards: the order of several matters), and the EAGLE3 page's out/shards
        cfg = ExtractConfig.from_file("scripts/demo_run.toml")
        assert extract(cfg.merged({"max_shard_samples": 8}), progress=False).samples == 40
        shutil.copytree(SHARDS, "out/shards")
    finally:
        os.chdir(cwd)
    return root


def run_block(folder: Path, page: str, body: str, line: int, monkeypatch) -> dict:
    monkeypatch.chdir(folder)
    ns: dict = {"__name__": "__docs__"}
    exec(compile(body, f"docs/{page}:{line}", "exec"), ns)  # noqa: S102 - the docs' own snippets
    return ns


# --------------------------------------------------------------------------- the tests


def test_every_docs_block_is_checked_or_says_why_not():
    keys = [(page, first) for page, first, _, _ in all_blocks()]
    assert len(keys) == len(set(keys)), "two blocks of one page start with the same line; make them differ"
    unknown = [k for k in keys if k not in CHECKS and k not in NOT_RUN]
    assert not unknown, f"docs Python blocks no test runs (add a check to CHECKS or a reason to NOT_RUN): {unknown}"
    assert set(CHECKS) | set(NOT_RUN) <= set(keys), f"stale entries: {(set(CHECKS) | set(NOT_RUN)) - set(keys)}"
    for page, first, body, line in all_blocks():
        if (page, first) in NOT_RUN:
            assert not READS_SHARDS.search(body), f"docs/{page}:{line} reads shards, so it must be run and checked"


@pytest.mark.slow
@pytest.mark.parametrize("key", list(CHECKS), ids=lambda k: f"{k[0]}:{k[1][:40]}")
def test_docs_block_gives_what_hsx_open_gives(folder, key, monkeypatch):
    page, first = key
    (body, line), = [(b, n) for p, f, b, n in all_blocks() if (p, f) == key]
    ns = run_block(folder, page, body, line, monkeypatch)
    CHECKS[key](ns, hsx.open(folder / SHARDS))


@pytest.mark.slow
def test_the_check_catches_the_rows_layout_snippet_on_default_shards(folder, monkeypatch):
    """The pandas snippet the docs once had: right for ``--compression none``, silently wrong on planes."""
    wrong = ('import numpy as np, pandas as pd, torch\n'
             'df = pd.read_parquet("demo_out/shards")\n'
             'cell = df["final"][0]\n'
             'h = torch.frombuffer(bytearray(b"".join(cell)), dtype=torch.bfloat16).view(len(cell), -1)\n')
    ns = run_block(folder, "READING.md", wrong, 0, monkeypatch)
    ds = hsx.open(folder / SHARDS)
    assert tuple(ns["h"].shape) == (2, ds[0].hidden("final").numel() // 2)  # the two byte planes, and no error
    with pytest.raises(AssertionError, match="shape"):
        check_pandas_cell(ns, ds)


def test_analysis_page_lists_every_helper_with_its_signature():
    import inspect

    from hsx import analysis as A

    page = (ROOT / "docs" / "ANALYSIS.md").read_text()
    listed = dict(re.findall(r"^\| `(\w+)\((.*?)\)` \|", page, re.M))
    public = {name: f for name, f in vars(A).items() if inspect.isfunction(f) and f.__module__ == A.__name__
              and not name.startswith("_")}
    assert set(listed) == set(public), f"ANALYSIS.md lists {sorted(set(listed) - set(public))} that do not exist, " \
                                       f"misses {sorted(set(public) - set(listed))}"
    for name, f in public.items():
        params = [str(p.replace(annotation=inspect.Parameter.empty)) for p in inspect.signature(f).parameters.values()]
        shown = []
        for p, param in zip(params, inspect.signature(f).parameters.values()):
            if param.kind is inspect.Parameter.KEYWORD_ONLY and "*" not in shown:
                shown.append("*")
            shown.append(p)
        assert listed[name] == ", ".join(shown), f"ANALYSIS.md: {name}({listed[name]}), the code has {name}({', '.join(shown)})"
