"""How hsx's own costs grow with a run's size: seconds and peak RSS per step, per sample, at several sizes.

Tiny samples (2 to 4 tokens, one hidden column of width 8) in many small shards, so that what grows is
hsx's bookkeeping (manifest commits, resume, opening), not the model or the bytes. Steps, each in a
fresh process (its peak resident memory is VmHWM, imports included):

  write       ShardSink over every sample, one commit per shard (``--per-shard`` samples a shard): the
              extract's writing and committing, without a model
  commits     the manifest alone: ``save_manifest`` once per shard entry (no shard files), the cost
              a run's commits add; cheap enough to run at 1M samples on a small machine
  rerun       what a rerun over the complete output does before any model: load the manifest, the set
              of done ids, a sink on it, close
  open        ``hsx.open``
  random      1,000 random ``ds[i]`` on an open output (its time per access, not per sample)
  inspect     ``hsx inspect``'s summary (small columns of every shard)
  verify      ``hsx verify`` (every shard read and checked)
  loader      ``hsx.tokens_loader`` over every row of column ``final``, shuffled (its default buffer)
  loader-start  the same loader's first batch: the time before training can start (its seconds are the step's)
  export      ``hsx export saelens`` of column ``final`` (contexts of 128 rows)
  input       the input side: a JSONL file of as many short rows (written beforehand, not timed) read
              through ``hsx.data.load_rows`` (HF datasets: converted once to a memory-mapped Arrow cache,
              in a temp folder here) and every row taken in order, as a run takes them
  input-disk  the same rows from a ``save_to_disk`` folder (made beforehand, not timed)
  extract     ``hsx extract --mode prefill`` end to end on a tiny random Llama (2 blocks, width 64, built
              here), one short text a sample, ``--per-shard`` samples a shard; its own output
  extract-gen the same with ``--mode generate`` and 4 new tokens a sample
  extract-ray ``extract`` with ``--ray``: two engine workers (1 CPU each) on a local Ray cluster the step
              starts; seconds, CPU and peak RSS are the driver's (it plans the units and commits them)
  ranks       the rank feed: two trainer processes under torchrun, each ``hsx.stream(config, rank, 2)`` over
              one pool of two Ray engine workers (prefill), counting its records; seconds are the slower
              rank's, CPU the ranks' sum, peak RSS the larger rank's (the Ray cluster, started beforehand,
              and its workers are not counted)
  extract-eagle3  ``extract --layers final,eagle3,8`` (prefill) on an 8-block tiny Llama (width 32), kept for the next two
  export-speculators  ``hsx export speculators`` of that output (a file per sample)
  export-specforge    ``hsx export specforge`` of that output (a file per sample)

    python scripts/bench_scale.py --samples 10000 100000               # local disk
    python scripts/bench_scale.py --samples 10000 --store s3://bucket/prefix   # endpoint from AWS_* variables
    python scripts/bench_scale.py --samples 1000000 --steps commits    # the manifest alone at 1M
    PYTHONPATH=/path/to/older/hsx python scripts/bench_scale.py ...    # the same steps on another hsx

A JSON input over 10 MB is converted to Arrow by a child process of the step (``hsx.data.convert``): its
CPU counts in the step's CPU, and its own peak RSS is reported beside the step's as ``child``.

Prints one table (seconds, microseconds per sample, the process's CPU seconds, peak RSS, and the bytes the
step handed to ``write(2)``, from ``/proc/self/io``: unlike wall seconds, CPU seconds do not count waits
for the disk's fsyncs, and bytes do not depend on the disk's load at all) and writes it as JSON with
``--json``. ``--keep`` leaves the outputs in ``--store`` and ``--reuse`` measures steps on the outputs a
run with ``--keep`` left there (its ``write`` not repeated).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STEPS = ("write", "commits", "rerun", "open", "random", "inspect", "verify", "loader", "loader-start", "export", "input",
         "input-disk",
         "extract", "extract-gen", "extract-ray", "ranks", "extract-eagle3", "export-speculators", "export-specforge")
EAGLE3 = ("extract-eagle3", "export-speculators", "export-specforge")  # one eagle3 output, made by the first
RANKS = 2  # trainer processes of the ``ranks`` step

CHILD = r"""
import json, logging, random, sys, time
import torch
torch.set_num_threads(1)
import hsx
from hsx.shards import Manifest, Record, ShardEntry, ShardSink, build_metadata, load_manifest
from hsx.shards.manifest import save_manifest
from hsx.shards.verify import inspect, verify
step, out, n, per_shard, aside = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
conversions = []  # a large input converted to Arrow by a child process: its cost is the step's


class Converted(logging.Handler):
    def emit(self, record):
        if hasattr(record, "conversion"):
            conversions.append(record.conversion)


logging.getLogger("hsx.data.convert").addHandler(Converted())
logging.getLogger("hsx.data.convert").setLevel(logging.INFO)

def written():  # bytes this process handed to write(2): shards, manifest, everything
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("wchar:"))

def peak_kb():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))

def resident_mb():  # at the end: the process's own memory, and shared memory it has touched (Ray's object store)
    with open("/proc/self/status") as f:
        got = {k: int(v.split()[0]) / 1024 for k, v in (line.split(":", 1) for line in f) if k in ("RssAnon", "RssShmem")}
    return {"anon_mb": got.get("RssAnon", 0.0), "shmem_mb": got.get("RssShmem", 0.0)}

meta = build_metadata(codec="planes-zstd", layers=[{"name": "final", "sources": [4], "width": 8, "raw_ids": None,
                      "rule": "bench"}], dtype="bfloat16", mode="prefill",
                      model={"path": "bench", "num_layers": 4, "hidden_size": 8},
                      engine={"name": "bench", "version": "0"}, dataset={"path": "bench", "fingerprint": "0"})
hidden = torch.randn(4, 8).to(torch.bfloat16)

def record(i):
    k = 2 + i % 3
    return Record(f"train:{i}", i, torch.arange(k) + i % 1000, 1, torch.ones(k, dtype=torch.uint8), "stop",
                  {"final": hidden[:k]})

def reset_peak():  # what a step prepares is not its cost: VmHWM starts again from here (Linux >= 4.0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")

if step == "input-disk":  # the saved folder, from the JSONL, before the clock starts
    import datasets
    datasets.load_dataset("json", data_files={"train": aside + ".jsonl"})["train"].save_to_disk(aside)
    datasets.disable_caching()
    reset_peak()
if step.startswith("extract") or step == "ranks":
    import os
    from hsx.config import ExtractConfig
    from hsx.run.pipeline import extract
    eagle3 = step == "extract-eagle3"
    scaled = {"ray": True, "num_workers": 2, "cpus_per_worker": 1.0,
              "ray_address": os.environ.get("BENCH_RAY_ADDRESS", "local")} if step in ("extract-ray", "ranks") else {}
    cfg = ExtractConfig(model=aside + ("-model8" if eagle3 else "-model"), dataset=aside + ".jsonl", output=out,
                        text_field="text", layers="final,eagle3,8" if eagle3 else "final",
                        mode="generate" if step == "extract-gen" else "prefill", max_new_tokens=4, batch_size=64,
                        max_shard_samples=per_shard, device="cpu", **scaled)
w0, t0, c0 = written(), time.perf_counter(), time.process_time()
if step == "write":
    sink = ShardSink(out, Manifest(meta, config_hash="bench"), max_shard_samples=per_shard)
    for i in range(n):
        sink.add(record(i))
    sink.close()
elif step == "commits":
    from pathlib import Path
    Path(out).mkdir(parents=True, exist_ok=True)
    m = Manifest(meta, config_hash="bench")
    save_manifest(out, m)
    for k in range(n // per_shard):
        ids = [f"train:{i}" for i in range(k * per_shard, (k + 1) * per_shard)]
        m.shards.append(ShardEntry(f"shard-{k:05d}.parquet", per_shard, 3 * per_shard, 3 * per_shard, 4000,
                                   "0" * 32, ids, list(range(k * per_shard, (k + 1) * per_shard))))
        save_manifest(out, m)
    m.complete = True
    save_manifest(out, m)
elif step == "rerun":
    m = load_manifest(out)
    done = m.done_ids()
    assert len(done) == n
    ShardSink(out, m, max_shard_samples=per_shard).close()
elif step == "open":
    assert len(hsx.open(out)) == n
elif step == "random":
    ds = hsx.open(out)
    rng = random.Random(0)
    t0, c0 = time.perf_counter(), time.process_time()  # the accesses only: not the open
    for _ in range(1000):
        s = ds[rng.randrange(len(ds))]
        assert s.hidden("final").shape[1] == 8
elif step == "inspect":
    assert inspect(out)["samples"] == n
elif step == "verify":
    assert verify(out).ok
elif step == "loader":
    rows = sum(len(batch["final"]) for batch in hsx.tokens_loader(out, ["final"], batch_size=4096))
    assert rows == sum(2 + i % 3 for i in range(n)), rows
elif step == "loader-start":
    assert len(next(iter(hsx.tokens_loader(out, ["final"], batch_size=4096)))["final"]) == min(4096, n * 2)
elif step == "export":
    from hsx.export import export_saelens
    export_saelens(out, aside, column="final", context_size=128, progress=False)
elif step in ("input", "input-disk"):
    from hsx.data.load import load_rows
    ds = load_rows(aside + ".jsonl" if step == "input" else aside)
    chars = sum(len(row["text"]) for row in ds)  # row by row, as a run takes them
    assert len(ds) == n and chars > 0
elif step.startswith("extract"):
    summary = extract(cfg, progress=False)
    assert summary.samples == n, summary
elif step == "ranks":
    feed = hsx.stream(cfg.validate(output=False).to_dict(), rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    try:
        got = sum(1 for _ in feed.records())
    finally:
        feed.close()
    assert got in (n // int(os.environ["WORLD_SIZE"]), -(-n // int(os.environ["WORLD_SIZE"]))), got
elif step == "export-speculators":
    from hsx.export import export_speculators
    assert export_speculators(out, aside + "-exported", progress=False).samples == n
elif step == "export-specforge":
    from hsx.export import export_specforge
    assert export_specforge(out, aside + "-exported", progress=False).samples == n
result = json.dumps({"seconds": time.perf_counter() - t0,
                     "cpu_s": time.process_time() - c0 + sum(c.cpu_s for c in conversions),
                     "peak_mb": peak_kb() / 1024, "child_peak_mb": max((c.peak_mb for c in conversions), default=0.0),
                     "written_mb": (written() - w0) / 2**20, **resident_mb()})
if step == "ranks":  # torchrun's ranks share a stdout: each writes a file of its own
    with open(f"{aside}.rank{os.environ['RANK']}.json", "w") as f:
        f.write(result)
print(result)
"""


def run_step(step: str, out: str, n: int, per_shard: int, aside: str, cache: str, ray_address: str | None = None) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_DATASETS_CACHE": cache}
    args = [step, out, str(n), str(per_shard), aside]
    # run from the temp folder: ``python -c`` puts its working directory first on sys.path, and a checkout's
    # hsx there would shadow the one PYTHONPATH names
    if step != "ranks":
        cmd = [sys.executable, "-c", CHILD, *args]
    else:  # torchrun runs a file: the child written beside the inputs
        Path(aside + ".child.py").write_text(CHILD)
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
            env.pop(name, None)
        env["BENCH_RAY_ADDRESS"] = ray_address
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(RANKS),
               "--max-restarts", "0", aside + ".child.py", *args]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, cwd=tempfile.gettempdir())
    if proc.returncode != 0:
        raise SystemExit(f"{step} at {n:,} samples failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    if step != "ranks":
        return json.loads(proc.stdout.strip().splitlines()[-1])
    ranks = [json.loads(Path(f"{aside}.rank{r}.json").read_text()) for r in range(RANKS)]
    return {"seconds": max(r["seconds"] for r in ranks), "cpu_s": sum(r["cpu_s"] for r in ranks),
            "peak_mb": max(r["peak_mb"] for r in ranks), "child_peak_mb": max(r["child_peak_mb"] for r in ranks),
            "written_mb": sum(r["written_mb"] for r in ranks),
            "anon_mb": max(r["anon_mb"] for r in ranks), "shmem_mb": max(r["shmem_mb"] for r in ranks)}


def location(base: str, name: str) -> str:
    return f"{base.rstrip('/')}/{name}" if base.startswith("s3://") else str(Path(base) / name)


def write_texts(path: Path, n: int) -> None:
    """``n`` JSON lines of a few words each (``{"text": ...}``), different from row to row."""
    words = ("the", "a", "model", "reads", "short", "texts", "and", "writes", "rows", "of", "states")
    with open(path, "w") as f:
        f.writelines(json.dumps({"text": " ".join(words[(i >> k) % len(words)] for k in range(0, 12, 3))}) + "\n"
                     for i in range(n))


def build_model(path: Path, num_layers: int = 2, hidden_size: int = 64) -> None:
    """A tiny random Llama and the demo tokenizer (no download): what is timed is hsx's own work."""
    import torch

    from hsx.demo.models import build_tiny_llama
    from hsx.demo.tokenizer import build_demo_tokenizer

    tok = build_demo_tokenizer()
    model = build_tiny_llama(num_layers=num_layers, hidden_size=hidden_size, vocab_size=len(tok))
    model.to(torch.float32).save_pretrained(path)
    tok.save_pretrained(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, nargs="+", default=[10_000, 100_000])
    ap.add_argument("--per-shard", type=int, default=10, help="samples a shard (default 10: many shards)")
    ap.add_argument("--steps", nargs="+", default=list(STEPS), choices=STEPS)
    ap.add_argument("--store", default=None, help="s3://BUCKET/PREFIX, or a local folder (default: a temp folder)")
    ap.add_argument("--keep", action="store_true", help="leave the outputs in --store (named n<SAMPLES>)")
    ap.add_argument("--reuse", action="store_true", help="measure on the outputs --keep left in --store")
    ap.add_argument("--outputs", nargs="+", default=None,
                    help="with --reuse: the outputs' names in --store, one per --samples (default n<SAMPLES>)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if (args.keep or args.reuse) and args.store is None:
        raise SystemExit("--keep and --reuse need --store")
    if args.outputs and (not args.reuse or len(args.outputs) != len(args.samples)):
        raise SystemExit("--outputs goes with --reuse, one name per --samples")
    base = args.store or tempfile.mkdtemp(prefix="hsx-bench-scale-")
    work = Path(tempfile.mkdtemp(prefix="hsx-bench-scale-work-"))  # inputs, the model, exports: local disk
    rows = []
    ray_address = None
    try:
        if any(step.startswith("extract") or step == "ranks" for step in args.steps):
            build_model(work / "texts-model")
        if any(step in EAGLE3 for step in args.steps):
            build_model(work / "texts-model8", num_layers=8, hidden_size=32)  # eagle3: 3 distinct boundaries
        if "ranks" in args.steps:  # one cluster for the ranks' runs (a rank joins it; it does not start one)
            import ray

            ray.init(address="local", num_cpus=os.cpu_count() or 2, include_dashboard=False, log_to_driver=False)
            ray_address = ray.get_runtime_context().gcs_address
        for n in args.samples:
            name = args.outputs[args.samples.index(n)] if args.outputs else f"n{n}"
            out = location(base, name if args.keep or args.reuse else f"n{n}-{int(time.time())}")
            eagle3_out = location(base, f"n{n}-eagle3" if args.keep or args.reuse else f"n{n}-eagle3-{int(time.time())}")
            texts = work / "texts"
            write_texts(texts.with_suffix(".jsonl"), n)
            for step in args.steps:
                if step == "write" and args.reuse or step == "extract-eagle3" and args.reuse:
                    continue
                target = eagle3_out if step in EAGLE3 else out
                if step in ("commits", "ranks") or step.startswith("extract") and step != "extract-eagle3":
                    target = location(base, f"n{n}-{step}-{int(time.time())}")
                r = run_step(step, target, n, args.per_shard, str(texts), str(work / "cache"), ray_address)
                if target not in (out, eagle3_out) and not args.keep and not target.startswith("s3://"):
                    shutil.rmtree(target, ignore_errors=True)
                for leftover in (work / "cache", texts, work / "texts-exported"):  # the datasets cache, a saved folder, an export
                    shutil.rmtree(leftover, ignore_errors=True)
                per = 1000 if step == "random" else n  # random: per access
                rows.append({"step": step, "samples": n, "shards": -(-n // args.per_shard), **r,
                             "us_per_sample": 1e6 * r["seconds"] / per, "cpu_us_per_sample": 1e6 * r["cpu_s"] / per})
                print(f"{step:11s} {n:>10,} samples {rows[-1]['shards']:>8,} shards  {r['seconds']:9.2f} s  "
                      f"{rows[-1]['us_per_sample']:9.1f} us/sample  cpu {rows[-1]['cpu_us_per_sample']:9.1f} us/sample  "
                      f"peak {r['peak_mb']:7.0f} MB (child {r['child_peak_mb']:4.0f})  written {r['written_mb']:9.1f} MB",
                      flush=True)
            if not args.keep and not eagle3_out.startswith("s3://"):
                shutil.rmtree(eagle3_out, ignore_errors=True)
    finally:
        if ray_address is not None:
            import ray

            ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)
        if args.store is None:
            shutil.rmtree(base, ignore_errors=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
