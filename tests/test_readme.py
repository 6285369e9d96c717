"""The README is a front page whose every command runs: the ``hsx`` and ``jupyter`` commands and the
Python snippets of its code blocks run here, in a folder laid out as its tour assumes (a tiny model,
draft and dataset under the names it uses); the others are listed in ``RUN_BY_CI`` and must be lines
of ``.ci/run``. A command in neither fails the test. Links in the README and docs/ must resolve."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
import torch
from typer.testing import CliRunner

from hsx.cli import app
from hsx.demo.models import build_tiny_llama, make_layerskip_draft
from hsx.demo.tokenizer import build_demo_tokenizer
from vl_models import build_vl, draw

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
CI = ROOT / ".ci" / "run"
PROMPTS = ROOT / "hsx" / "demo_data" / "prompts.jsonl"
MAX_BYTES = 12 * 1024

# README command (normalised: comments dropped, one space between words) -> (the file that runs it, its
# line there). .ci/run runs them in its own folders: its lines, as compared, lose "$scratch/" and
# "$HSX_VENV/bin/".
TOUR = "python scripts/train_eagle3_demo.py --shards demo_out/shards --save-head demo_out/eagle3_head"
EXPORTS = ("hsx export specforge demo_out/shards demo_out/specforge",
           "hsx export speculators demo_out/shards demo_out/speculators",
           "hsx export saelens demo_out/shards demo_out/saelens --column b8 --context-size 64")
RUN_BY_CI = {
    "bash scripts/demo.sh": (CI, "bash scripts/demo.sh demo_out"),  # demo_out: demo.sh's default output
    "bash scripts/test.sh": (CI, "bash scripts/test.sh"),
    TOUR: (CI, TOUR),
    **{export: (CI, export) for export in EXPORTS},
}
RUN_HERE = ("hsx", "jupyter")  # programs whose README commands this file runs


def code_blocks(text: str) -> list[tuple[str, str, int]]:
    """(language, body, line number) of every fenced block."""
    return [(m.group(1).strip(), m.group(2), text.count("\n", 0, m.start()) + 1)
            for m in re.finditer(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", text, re.M | re.S)]


def shell_commands(body: str) -> list[tuple[str, str]]:
    """(normalised, as written) for each logical line of a shell block; backslash continuations joined."""
    out = []
    for line in body.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        if words:
            out.append((" ".join(words), line))
    return out


def program(words: list[str]) -> str:
    """The command's program, past leading VAR=value assignments."""
    return next(w for w in words if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", w))


def readme_commands() -> list[tuple[str, str]]:
    return [c for lang, body, _ in code_blocks(README.read_text()) if lang == "bash" for c in shell_commands(body)]


def ci_lines() -> set[str]:
    """.ci/run's command lines, written as the README writes them (its folders and venv taken out, and a
    ``| tee LOG`` that keeps their output)."""
    lines = set()
    for line in CI.read_text().splitlines():
        line = line.replace('"$scratch/', '"').replace('"$HSX_VENV/bin/', '"')
        line = re.sub(r'\s*\|\s*tee\s+"[^"]*"\s*$', "", line)
        if (words := shlex.split(line, comments=True)):
            lines.add(" ".join(words))
    return lines


def test_every_block_declares_its_language_and_none_is_indented():
    text = README.read_text()
    for lang, _, line in code_blocks(text):
        assert lang in ("bash", "python", "text"), f"README.md:{line}: a code block must be bash, python or text"
    outside = re.sub(r"^```.*?^```[ \t]*$", "", text, flags=re.M | re.S)
    assert not re.search(r"\n\n {4,}\S", outside), "README.md has an indented code block: fence it so its commands are run"


def test_every_readme_command_is_run_here_or_by_ci():
    commands = readme_commands()
    assert len(commands) >= len(RUN_BY_CI) + 5, commands
    unrun = [c for c, _ in commands if c not in RUN_BY_CI and program(c.split()) not in RUN_HERE]
    assert unrun == [], f"README commands that no test or CI step runs (run them here or map them in RUN_BY_CI): {unrun}"


def test_the_ci_mapping_names_lines_ci_really_runs():
    commands = {c for c, _ in readme_commands()}
    assert set(RUN_BY_CI) <= commands, f"RUN_BY_CI maps commands the README no longer has: {set(RUN_BY_CI) - commands}"
    lines = ci_lines()
    for command, (where, line) in RUN_BY_CI.items():
        assert where == CI and line in lines, f"{where.relative_to(ROOT)} has no line running {command!r} ({line!r})"


def test_readme_is_a_front_page():
    size = len(README.read_bytes())
    assert size < MAX_BYTES, f"README.md is {size:,} bytes; move reference text to docs/ (limit {MAX_BYTES:,})"


def slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("page", [README, ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    text = page.read_text()
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"^[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        assert dest.exists(), f"{page.relative_to(ROOT)} links to {target}, which does not exist"
        if anchor and dest.suffix == ".md":
            headings = {slug(h) for h in re.findall(r"^#+ (.*)$", dest.read_text(), re.M)}
            assert anchor in headings, f"{page.relative_to(ROOT)} links to {target}: no such heading"


# --------------------------------------------------------------------------- the tour, run


@pytest.fixture(scope="module")
def tour(tmp_path_factory) -> Path:
    """A folder holding what the tour names: my_model, my_draft, my_data.jsonl (12 of the demo prompts)
    and a copy of notebooks/."""
    root = tmp_path_factory.mktemp("tour")
    tok = build_demo_tokenizer()
    target = build_tiny_llama(num_layers=8, hidden_size=64, vocab_size=len(tok), seed=1, bos_token_id=tok.bos_token_id,
                              eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    for name, model in (("my_model", target), ("my_draft", make_layerskip_draft(target, num_layers=2))):
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    rows = PROMPTS.read_text().splitlines()[:12]
    (root / "my_data.jsonl").write_text("\n".join(rows) + "\n")
    shutil.copytree(ROOT / "notebooks", root / "notebooks")
    # the Images example: a tiny Qwen2.5-VL, the picture it names, and its chat line as the dataset
    build_vl("qwen2_5_vl", root / "my_vl_model")
    (root / "photos").mkdir()
    draw(root / "photos" / "cat.png", 64, 96, 1)
    (root / "my_images.jsonl").write_text(image_chat_line() + "\n")
    return root


def image_chat_line() -> str:
    """The README's example row with an image (its one text block that is a JSON object)."""
    lines = [body.strip() for lang, body, _ in code_blocks(README.read_text())
             if lang == "text" and body.strip().startswith("{")]
    assert len(lines) == 1 and json.loads(lines[0])["messages"][0]["content"][0]["type"] == "image", lines
    return lines[0]


def tool_env() -> dict[str, str]:
    """This interpreter's venv first on PATH (the README's commands run inside it), this checkout first
    on PYTHONPATH, and matplotlib's backend left for the notebook's kernel to choose."""
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env.pop("MPLBACKEND", None)
    return env


def run_shell(line: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", line], cwd=cwd, env=tool_env(), capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_the_tour_runs_as_written(tour, monkeypatch):
    torch.set_num_threads(1)
    monkeypatch.chdir(tour)
    runner = CliRunner()
    ran = []
    for lang, body, line in code_blocks(README.read_text()):
        if lang == "python":  # in a fresh interpreter, as a reader would run it
            proc = subprocess.run([sys.executable, "-c", body], cwd=tour, env=tool_env(), capture_output=True,
                                  text=True, timeout=600)
            assert proc.returncode == 0, f"README.md:{line}: the Python block fails\n{proc.stderr[-3000:]}"
            ran.append(f"python block at line {line}")
            continue
        if lang != "bash":
            continue
        for command, as_written in shell_commands(body):
            words = command.split()
            if command in RUN_BY_CI:
                continue
            if program(words) == "hsx":
                result = runner.invoke(app, words[1:])
                assert result.exit_code == 0, f"{command}\n{result.output}"
            else:
                proc = run_shell(as_written, tour)
                assert proc.returncode == 0, f"{command}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
            ran.append(command)
    assert len(ran) >= 6, ran
    # what the tour says it made
    import hsx

    gen, pre = hsx.open(tour / "out" / "run1"), hsx.open(tour / "out" / "run2")
    assert len(gen) == 12 and gen.metadata["mode"] == "generate" and gen[0].accept_lens is not None
    assert [g["name"] for g in gen.metadata["layers"]] == ["final", "eagle3", "b0"]
    assert pre.metadata["mode"] == "prefill" and pre.metadata["keep"] == "loss"
    executed = nbformat.read(tour / "run1-analysis.ipynb", as_version=4)
    outputs = [o for c in executed.cells if c.cell_type == "code" for o in c.outputs]
    assert outputs and not [o for o in outputs if o.output_type == "error"]
    assert "ShardDataset(12 samples" in "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert json.loads((tour / "out" / "run1" / ".hsx-config.json").read_text())["draft_model"] == "my_draft"
    vl = hsx.open(tour / "out" / "run3")
    assert len(vl) == 1 and vl.metadata["vision"]["model_type"] == "qwen2_5_vl"
    assert vl[0].vision["images"][0]["source"] == "photos/cat.png" and int(vl[0].vision["image_mask"].sum()) > 0


def test_the_demo_check_accepts_other_times_and_refuses_other_figures(tmp_path, capsys):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import check_readme_demo as check
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    quoted = check.quoted_demo(README.read_text())
    out = "/scratch/ci/demo_out"
    log = [line.replace("demo_out", out) for line in quoted]
    timed = next(k for k, line in enumerate(log) if check.TIMING.search(line))
    log[timed] = check.TIMING.sub("99.9 s", log[timed])  # another machine's times
    (tmp_path / "ok.log").write_text("\n".join(["(a line the README trims)", *log]) + "\n")
    cpu = check.quoted_cpu(README.read_text())  # the kind of CPU the README's output comes from
    assert cpu and check.main(str(tmp_path / "ok.log"), out, cpu) == 0
    sized = next(k for k, line in enumerate(log) if " MB" in line)
    log[sized] = re.sub(r"[\d.]+ MB", "9.9 MB", log[sized])  # a figure gone stale
    (tmp_path / "stale.log").write_text("\n".join(log) + "\n")
    assert check.main(str(tmp_path / "stale.log"), out, cpu) == 1
    assert "did not print" in capsys.readouterr().out
    # another kind of CPU trains other demo models: its figures differ, the lines' words may not
    assert check.main(str(tmp_path / "stale.log"), out, "another CPU") == 0
    assert "figures are set aside" in capsys.readouterr().out
    log[sized] = log[sized].replace(" MB", " GB")
    (tmp_path / "worded.log").write_text("\n".join(log) + "\n")
    assert check.main(str(tmp_path / "worded.log"), out, "another CPU") == 1


def test_the_readme_names_the_cpu_of_its_demo_output():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import check_readme_demo as check
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    assert re.fullmatch(r"(Intel|AMD|unknown) with (AMX|AVX-512|AVX2|no AVX2)", check.quoted_cpu(README.read_text()))
    assert re.fullmatch(r"(Intel|AMD|unknown) with (AMX|AVX-512|AVX2|no AVX2)", check.this_cpu())
