"""`hsx extract --ray --num-workers N` against the single process on the same data, whole commands timed.

Each side is one `hsx extract` process, timed from its start to its exit (imports, Ray's start
and shutdown, engine loads, dataset, shards); the summary's own seconds are printed too. The
single process runs twice: with torch's default threads (what a user gets) and with one thread
per engine, the setting a Ray worker of <= 1 CPU gets, whose rows must equal the Ray run's bit
for bit (checked here). Writes JSON under bench_out/.

    python scripts/bench_ray.py [--samples 256] [--workers 2] [--hidden 256] [--layers 4] [--max-new-tokens 32]
                                [--skip-default-threads]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import hsx
from hsx.demo.models import build_tiny_llama
from hsx.demo.tokenizer import build_demo_tokenizer, demo_corpus


def run(args: list[str], threads: int | None) -> tuple[float, float, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", "from hsx.cli import main; main()", *args], env=env,
                          capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode:
        sys.exit(f"hsx extract failed:\n{done.stdout}\n{done.stderr}")
    inner = float(re.search(r" in ([0-9.]+) s ", done.stdout).group(1))
    return wall, inner, done.stdout


def same_rows(a_dir: Path, b_dir: Path) -> bool:
    a, b = hsx.open(a_dir), hsx.open(b_dir)
    if sorted(a.sample_ids) != sorted(b.sample_ids) or len(set(b.sample_ids)) != len(b):
        return False
    for sid in a.sample_ids:
        x, y = a.select([sid])[0], b.select([sid])[0]
        if not torch.equal(x.input_ids, y.input_ids):
            return False
        if any(not torch.equal(x.hidden(n).view(torch.int16), y.hidden(n).view(torch.int16)) for n in a.columns):
            return False
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--skip-default-threads", action="store_true",
                    help="leave out the single process with torch's default threads (slow on a loaded machine)")
    a = ap.parse_args()

    root = Path(tempfile.mkdtemp(prefix="hsx-bench-ray-"))
    tok = build_demo_tokenizer()
    model = build_tiny_llama(num_layers=a.layers, hidden_size=a.hidden, vocab_size=len(tok), seed=0,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    words = demo_corpus().split()
    gen = torch.Generator().manual_seed(0)
    lines = []
    for i in range(a.samples):
        n = int(torch.randint(8, 64, (1,), generator=gen))
        start = int(torch.randint(0, len(words) - n, (1,), generator=gen))
        lines.append(json.dumps({"id": f"b{i}", "text": " ".join(words[start:start + n])}))
    (root / "data.jsonl").write_text("\n".join(lines) + "\n")

    common = ["extract", "--model", str(root / "model"), "--dataset", str(root / "data.jsonl"), "--id-field", "id",
              "--max-new-tokens", str(a.max_new_tokens), "--batch-size", str(a.batch_size), "--quiet"]
    unit = 4 * a.batch_size
    results = {}
    sides = [] if a.skip_default_threads else [("single, default threads", [], None)]
    for name, extra, threads in [
        *sides,
        ("single, 1 thread", [], 1),
        (f"ray, {a.workers} workers x 1 CPU", ["--ray", "--ray-address", "local", "--num-workers", str(a.workers),
                                               "--cpus-per-worker", "1", "--unit-size", str(unit)], None),
    ]:
        out = root / re.sub(r"\W+", "-", name)
        wall, inner, text = run([*common, "-o", str(out), *extra], threads)
        results[name] = {"wall_s": round(wall, 2), "run_s": round(inner, 2), "out": str(out)}
        print(f"{name:<28} wall {wall:7.1f} s   run {inner:7.1f} s", flush=True)
    ray_out = Path(results[f"ray, {a.workers} workers x 1 CPU"]["out"])
    identical = same_rows(Path(results["single, 1 thread"]["out"]), ray_out)
    print(f"ray rows bit-identical to the 1-thread single process: {identical}")
    base = results["single, 1 thread"]["wall_s"]
    for name, r in results.items():
        print(f"  {name:<28} {base / r['wall_s']:.2f}x the speed of the 1-thread single process (wall)")
    for r in results.values():
        r.pop("out")
    record = {"args": vars(a), "cpus": os.cpu_count(), "loadavg_at_end": os.getloadavg(), "results": results,
              "bit_identical": identical}
    Path("bench_out").mkdir(exist_ok=True)
    Path("bench_out/bench_ray.json").write_text(json.dumps(record, indent=1))
    shutil.rmtree(root)


if __name__ == "__main__":
    main()
