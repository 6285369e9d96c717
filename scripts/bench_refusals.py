"""How long a new user waits for the error of a trivial mistake: whole ``hsx extract`` processes.

    .venv/bin/python scripts/bench_refusals.py [--repeats 3] [--json bench_out/refusals.json]

Builds a tiny model directory, a JSON-lines dataset and an output of a finished run in a temporary
directory, then times each mistaken command from process start to exit (median of ``--repeats``),
next to two baselines measured in the same run: ``python -c pass`` (the interpreter) and
``python -c "import torch"`` (what any model load pays first). Each command must exit 2 with an
``error:`` line; the table shows that line. Run it with another checkout first on PYTHONPATH to
compare.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def build(work: Path) -> dict:
    from hsx.demo.models import build_tiny_llama
    from hsx.demo.tokenizer import build_demo_tokenizer

    model = work / "model"
    tok = build_demo_tokenizer()
    build_tiny_llama(num_layers=2, hidden_size=32, vocab_size=len(tok), seed=0, eos_token_id=tok.eos_token_id,
                     pad_token_id=tok.pad_token_id).save_pretrained(model)
    tok.save_pretrained(model)
    (work / "empty").mkdir()
    data = work / "data.jsonl"
    data.write_text("".join(json.dumps({"id": f"r{i}", "text": f"Row {i} about the rain."}) + "\n" for i in range(4)))
    done = work / "done"
    base = _extract(model, data, done)
    subprocess.run(base, check=True, capture_output=True, env=_env(), cwd=work)
    return {"model": str(model), "data": str(data), "done": str(done), "work": work}


def _extract(model, data, out, *extra) -> list[str]:
    return [sys.executable, "-m", "hsx.cli", "extract", "--model", str(model), "--dataset", str(data), "-o", str(out),
            "--max-new-tokens", "2", "--quiet", *extra]


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def cases(b: dict) -> dict[str, list[str]]:
    m, d, out = b["model"], b["data"], str(b["work"] / "out")
    return {
        "mistyped --model path": _extract(m + "x", d, out),
        "relative path under an existing directory": _extract("model/targt", d, out),
        "hub id, hub unreachable": _extract("someorg/somemodel", d, out),
        "empty model directory": _extract(b["work"] / "empty", d, out),
        "missing dataset": _extract(m, b["work"] / "nope.jsonl", out),
        "config differs from the output's": _extract(m, d, b["done"], "--max-new-tokens", "3"),
        "--layers 999": _extract(m, d, out, "--layers", "999"),
        "--keep completion --mode prefill": _extract(m, d, out, "--keep", "completion", "--mode", "prefill"),
        "--text-field not a column": _extract(m, d, out, "--text-field", "body"),
    }


def timed(cmd: list[str], cwd: Path, repeats: int, expect_error: bool) -> tuple[float, str]:
    times, last = [], ""
    for _ in range(repeats):
        t0 = time.perf_counter()
        p = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=cwd, timeout=600)
        times.append(time.perf_counter() - t0)
        if expect_error:
            last = next((x for x in p.stderr.splitlines() if x.startswith("error: ")), "")
            if p.returncode != 2 or not last:
                raise SystemExit(f"{cmd} exited {p.returncode}, expected 2 with an error line:\n{p.stderr[-2000:]}")
    return statistics.median(times), last


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path, default=Path("bench_out/refusals.json"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        b = build(work)
        base = {name: timed([sys.executable, "-c", code], work, args.repeats, False)[0]
                for name, code in (("python -c pass", "pass"), ("python -c 'import torch'", "import torch"))}
        results = {name: timed(cmd, work, args.repeats, True) for name, cmd in cases(b).items()}
    width = max(map(len, [*results, *base]))
    for name, seconds in base.items():
        print(f"{name:<{width}}  {seconds:6.2f} s  (baseline)")
    torch_s = base["python -c 'import torch'"]
    for name, (seconds, line) in results.items():
        print(f"{name:<{width}}  {seconds:6.2f} s  {seconds / torch_s:4.2f}x import torch  {line[:110]}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"repeats": args.repeats, "baselines_s": base,
                                     "cases": {k: {"seconds": s, "error": e} for k, (s, e) in results.items()}}, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
