"""Records per second of a feed shared by two trainer ranks against one rank, on the same two engine workers.

    python scripts/bench_stream_ranks.py [--samples 256] [--passes 4] [--repeats 4] [--mode prefill|generate]
                                         [--hidden 256] [--layers 4] [--cpus-per-worker 1] [--out FILE.json]

The script starts a local Ray cluster (``--cluster-cpus``, default every core) and, on it, per repeat
and in alternating order: one trainer process (``hsx.stream`` with ``world_size`` 1: the engines
on Ray, this process their one consumer) and two trainer ranks under torchrun (``python -m
torch.distributed.run --nproc_per_node 2``, ``world_size`` 2: one pool of engines shared by both).
Every side has ``--workers`` engine workers of a random-init Llama (``--layers`` blocks, hidden
``--hidden``) over ``--samples`` prompts, and runs ``--passes`` passes; a consumer only counts
records. A pass's time runs from the first rank's start of it to the last rank's end of it (one
clock: one machine); its throughput is every rank's records over that time. Passes after the
first (which pays first calls) are the ones compared: the ratio two ranks / one rank of each
repeat's median, and the median of the ratios. Both sides must give the same records (checked).
JSON goes to ``bench_out/bench_stream_ranks.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def worker(run_file: str, passes: int, out: str) -> None:
    """One trainer process (a rank under torchrun, or alone): ``passes`` passes, each timed, records counted."""
    import torch

    import hsx

    torch.set_num_threads(1)
    t0 = time.time()
    feed = hsx.stream(run_file, ahead=64)
    result = {"rank": feed.rank, "world_size": feed.world_size, "start_s": time.time() - t0, "passes": []}
    try:
        for _ in range(passes):
            start, records, rows, ids = time.time(), 0, 0, []
            for record in feed.records():
                records += 1
                rows += record.num_rows
                ids.append(record.sample_id)
            result["passes"].append({"start": start, "end": time.time(), "records": records, "rows": rows, "ids": ids})
    finally:
        feed.close()
    Path(out, f"rank{feed.rank}-of-{feed.world_size}.json").write_text(json.dumps(result))


def build(root: Path, a) -> Path:
    """The model, the prompts and the run's config file; returns the config file."""
    from hsx.config import ExtractConfig
    from hsx.demo.models import build_tiny_llama
    from hsx.demo.tokenizer import build_demo_tokenizer, demo_corpus

    tok = build_demo_tokenizer()
    model = build_tiny_llama(num_layers=a.layers, hidden_size=a.hidden, vocab_size=len(tok), seed=0,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model.save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    words = demo_corpus().split()
    gen = random.Random(0)
    lines = []
    for i in range(a.samples):  # 8-64 words from the demo corpus, as scripts/bench_ray.py
        n = gen.randint(8, 63)
        start = gen.randint(0, len(words) - n - 1)
        lines.append(json.dumps({"id": f"p{i}", "text": " ".join(words[start:start + n])}))
    (root / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    return root / "config.json"


def side(a, run_file: Path, world: int, out: Path) -> dict:
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(name, None)
    me = [__file__, "--worker", str(run_file), "--passes", str(a.passes), "--out", str(out)]
    if world == 1:
        cmd = [sys.executable, *me]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world),
               "--max-restarts", "0", *me]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode:
        sys.exit(f"the {world}-rank side failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    ranks = [json.loads((out / f"rank{r}-of-{world}.json").read_text()) for r in range(world)]
    passes = []
    for p in range(a.passes):
        each = [r["passes"][p] for r in ranks]
        seconds = max(e["end"] for e in each) - min(e["start"] for e in each)
        records = sum(e["records"] for e in each)
        passes.append({"seconds": seconds, "records": records, "rows": sum(e["rows"] for e in each),
                       "records_per_s": records / seconds, "ids": sorted(i for e in each for i in e["ids"])})
    return {"world_size": world, "wall_s": wall, "start_s": max(r["start_s"] for r in ranks), "passes": passes}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=256)
    p.add_argument("--passes", type=int, default=4)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--mode", default="prefill", choices=["prefill", "generate"])
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--unit-size", type=int, default=32)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--cpus-per-worker", type=float, default=1.0)
    p.add_argument("--cluster-cpus", type=int, default=os.cpu_count() or 2)
    p.add_argument("--out", default="bench_out/bench_stream_ranks.json")
    p.add_argument("--worker", metavar="RUN_FILE", help=argparse.SUPPRESS)  # a trainer process; --out is its folder
    a = p.parse_args(argv)
    if a.worker:
        worker(a.worker, a.passes, a.out)
        return {}
    if a.passes < 2:
        sys.exit("--passes must be >= 2: the first pass is not compared")
    import ray

    from hsx.config import ExtractConfig

    ray.init(address="local", num_cpus=a.cluster_cpus, include_dashboard=False, log_to_driver=False)
    address = ray.get_runtime_context().gcs_address
    repeats = []
    try:
        with tempfile.TemporaryDirectory(prefix="hsx-bench-ranks-") as tmp:
            root = Path(tmp)
            run_file = build(root, a)
            cfg = ExtractConfig(model=str(root / "target"), dataset=str(root / "prompts.jsonl"), id_field="id", output="",
                                layers="final,eagle3", mode=a.mode, max_new_tokens=a.max_new_tokens,
                                batch_size=a.batch_size, window=a.batch_size * 2, ray=True, ray_address=address,
                                num_workers=a.workers, cpus_per_worker=a.cpus_per_worker, unit_size=a.unit_size)
            run_file.write_text(json.dumps(cfg.validate(output=False).to_dict()))
            for r in range(a.repeats):
                order = [1, 2] if r % 2 == 0 else [2, 1]
                got = {w: side(a, run_file, w, root / f"repeat{r}-world{w}") for w in order}
                one, two = got[1], got[2]
                for p1, p2 in zip(one["passes"], two["passes"]):
                    if p1["ids"] != p2["ids"]:
                        sys.exit("the two sides gave different records")
                warm = lambda s: statistics.median(x["records_per_s"] for x in s["passes"][1:])  # noqa: E731
                repeats.append({"first": order[0], "one_rank": _strip(one), "two_ranks": _strip(two),
                                "ratio": warm(two) / warm(one),
                                "first_pass_ratio": two["passes"][0]["records_per_s"] / one["passes"][0]["records_per_s"]})
                print(f"repeat {r}: one rank {warm(one):.1f} records/s, two ranks {warm(two):.1f} records/s, "
                      f"ratio {repeats[-1]['ratio']:.3f} (first pass {repeats[-1]['first_pass_ratio']:.3f}; "
                      f"whole commands {one['wall_s']:.1f} s and {two['wall_s']:.1f} s)", flush=True)
    finally:
        ray.shutdown()
    result = {"args": {k: v for k, v in vars(a).items() if k != "worker"}, "repeats": repeats,
              "ratio_median": statistics.median(x["ratio"] for x in repeats),
              "first_pass_ratio_median": statistics.median(x["first_pass_ratio"] for x in repeats)}
    print(f"two ranks / one rank, records/s of the passes after the first: median {result['ratio_median']:.3f} "
          f"over {len(repeats)} repeats")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    return result


def _strip(s: dict) -> dict:
    return {**s, "passes": [{k: v for k, v in x.items() if k != "ids"} for x in s["passes"]]}


if __name__ == "__main__":
    main()
