"""notebooks/analysis.ipynb: stored without outputs, and executed end to end on shards that a tiny
target + draft pair writes through ``hsx.run.pipeline.extract`` (speculative decoding, several shards)."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import nbformat
import numpy as np
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient
from typer.testing import CliRunner

import hsx
from hsx import analysis as A
from hsx.cli import app
from hsx.config import ExtractConfig
from hsx.demo.models import build_tiny_llama, make_layerskip_draft
from hsx.demo.tokenizer import build_demo_tokenizer
from hsx.run.pipeline import extract

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "analysis.ipynb"
PROMPTS = Path(__file__).resolve().parents[1] / "hsx" / "demo_data" / "prompts.jsonl"
CELL_TIMEOUT_S = 900  # a guard against a hung kernel, not a speed check: the outcome never depends on load


@pytest.fixture(scope="module")
def demo_shards(tmp_path_factory) -> Path:
    """Demo-like shards, small: 16 of the demo prompts, 10 new tokens, at most 6 samples per shard."""
    root = tmp_path_factory.mktemp("nb_demo")
    tok = build_demo_tokenizer()
    target = build_tiny_llama(num_layers=8, hidden_size=64, vocab_size=len(tok), seed=1, bos_token_id=tok.bos_token_id,
                              eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    draft = make_layerskip_draft(target, num_layers=2)
    for name, m in (("target", target), ("draft", draft)):
        m.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    # the models given relative to the run's folder, as a user types them: the notebook, run from
    # notebooks/, must still find the tokenizer
    cfg = ExtractConfig(model="target", draft_model="draft", dataset=str(PROMPTS),
                        id_field="id", limit=16, output=str(root / "shards"), layers="final,eagle3,0,8",
                        max_new_tokens=10, batch_size=16, spec_num_steps=3, spec_topk=1, spec_num_draft_tokens=4,
                        max_shard_samples=6)
    cwd = os.getcwd()
    os.chdir(root)
    try:
        summary = extract(cfg, progress=False)
    finally:
        os.chdir(cwd)
    assert summary.samples == 16 and summary.errors == 0
    return root / "shards"


def test_saved_notebook_has_no_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code, "the notebook has no code cells"
    for i, c in enumerate(code):
        assert c.outputs == [] and c.execution_count is None, f"code cell {i} carries outputs; strip them"
    assert 'SHARDS = os.environ.get("HSX_SHARDS", "../demo_out/shards")' in code[0].source


def kernel_manager(tmp_path: Path) -> KernelManager:
    """A kernel on this interpreter, from a kernelspec written here: independent of user or system
    kernelspecs, so it works in a brand-new virtualenv where nothing was registered. IPC sockets in
    the test's folder instead of TCP ports that another process could take between choice and bind."""
    spec_dir = tmp_path / "kernels" / "hsx-python"
    spec_dir.mkdir(parents=True)
    spec = {"argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "hsx test kernel", "language": "python"}
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    ksm = KernelSpecManager(kernel_dirs=[str(tmp_path / "kernels")], ensure_native_kernel=False)
    km = KernelManager(kernel_name="hsx-python", kernel_spec_manager=ksm)
    if sys.platform != "win32":
        km.transport, km.ip = "ipc", str(tmp_path / "kernel")
    return km


def test_notebook_executes_on_fresh_shards(demo_shards, tmp_path, monkeypatch):
    monkeypatch.setenv("HSX_SHARDS", str(demo_shards))
    monkeypatch.delenv("MPLBACKEND", raising=False)  # the kernel's inline backend makes the figures
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(nb, km=kernel_manager(tmp_path), timeout=CELL_TIMEOUT_S,
                            resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    client.execute()  # raises CellExecutionError naming the failing cell
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    warned = [o.get("text", "") for o in outputs if o.get("name") == "stderr"]
    assert not warned, warned  # no warning of a library (tqdm's IProgress notice, ...) in a cell
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "ShardDataset(16 samples, 3 shards" in text
    assert "tokenizer: not found" not in text  # the run's tokenizer directory was found
    assert "next token starts a new word" in text
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) == 4  # PCA, probe, accept lengths, norms


def test_helpers_on_extracted_shards(demo_shards):
    ds = hsx.open(demo_shards)
    table = A.token_table(ds)
    assert len(table) == ds.tokens("final").hidden.shape[0] == A.states(ds, "eagle3").shape[0]
    # each verify step emitted accept_lens[k] of the kept tokens; only the last one may have been cut
    steps = table.dropna(subset=["accept_step"])
    for s in ds:
        a = s.accept_lens.long().numpy()
        mine = steps.loc[steps["sample"] == s.index, "accept_step"].to_numpy(dtype=np.int64)
        # the table has no row for the last token (generate mode): add its step back
        last = A.accept_steps(s.prompt_len, len(s.input_ids), a)[-1]
        counts = np.bincount(np.append(mine[mine >= 0], last) if last >= 0 else mine[mine >= 0], minlength=a.size)
        assert (counts[:-1] == a[:-1]).all() and 0 < counts[-1] <= a[-1], s.sample_id
        assert (mine == -1).sum() == 1
    stats = A.accept_stats(ds)
    assert stats.histogram.sum() == sum(len(s.accept_lens) for s in ds)
    layers = [sl.label for sl in A.layer_sources(ds)]
    assert layers == ["b0", "b2", "b4", "b5", "b8", "final"]


def test_the_runs_model_and_tokenizer_are_found_from_another_directory(demo_shards, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # "target", as the run was given it, is not here
    ds = hsx.open(demo_shards)
    assert ds.metadata["model"]["path"] == "target"  # what the user typed stays recorded
    assert ds.metadata["model"]["resolved_path"] == str((demo_shards.parent / "target").resolve())
    assert ds.model_path() == (demo_shards.parent / "target").resolve()
    tok = ds.tokenizer()
    assert tok.decode(ds[0].input_ids[:5].tolist()) == A.load_tokenizer(ds).decode(ds[0].input_ids[:5].tolist())
    checked = CliRunner().invoke(app, ["verify", str(demo_shards), "--recompute", "--samples", "3", "--quiet"])
    assert checked.exit_code == 0, checked.output
    assert "recompute: OK" in checked.output


def test_a_tokenizer_that_is_nowhere_is_a_clear_error(demo_shards, tmp_path, monkeypatch):
    moved = tmp_path / "copy"
    shutil.copytree(demo_shards, moved)
    ds = hsx.open(moved)
    ds.metadata["model"] = ds.metadata["tokenizer"] = {"path": "gone", "resolved_path": "/nowhere/gone"}
    with pytest.raises(hsx.HsxError, match="not on this machine.*/nowhere/gone"):
        ds.tokenizer()
    assert A.load_tokenizer(ds) is None


def test_notebook_reads_an_output_in_an_object_store(demo_shards, tmp_path, monkeypatch):
    """The same shards copied into an S3-compatible store (SeaweedFS on the loopback address): the
    notebook, given ``HSX_SHARDS=s3://...``, runs through and prints what it prints on local disk."""
    from s3_server import S3Server

    server = S3Server(tmp_path / "s3").start()
    try:
        client = server.client()
        for f in sorted(demo_shards.rglob("*")):  # the whole output: shards, manifest head and its log folder
            if f.is_file():
                key = f"nb/{f.relative_to(demo_shards).as_posix()}"
                client.put_object(Bucket=server.bucket, Key=key, Body=f.read_bytes())
        for k, v in server.env().items():
            monkeypatch.setenv(k, v)
        monkeypatch.setenv("HSX_SHARDS", f"s3://{server.bucket}/nb")
        monkeypatch.delenv("MPLBACKEND", raising=False)
        nb = nbformat.read(NOTEBOOK, as_version=4)
        client = NotebookClient(nb, km=kernel_manager(tmp_path), timeout=CELL_TIMEOUT_S,
                                resources={"metadata": {"path": str(NOTEBOOK.parent)}})
        client.execute()
    finally:
        server.stop()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    warned = [o.get("text", "") for o in outputs if o.get("name") == "stderr"]
    assert not warned, warned  # no warning of a library (tqdm's IProgress notice, ...) in a cell
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "ShardDataset(16 samples, 3 shards" in text and "next token starts a new word" in text
    assert "tokenizer: not found" not in text  # found through the run's recorded (resolved) path
    assert len([o for o in outputs if "image/png" in o.get("data", {})]) == 4
