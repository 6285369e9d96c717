"""What hsx's vLLM engine costs: ``hsx extract --engine vllm`` against plain ``vllm.LLM.generate``, in one run.

Run inside the vLLM CPU lane:

    bash scripts/vllm_cpu.sh python scripts/bench_vllm.py [--sizes 64x32,16x128] [--repeats 3] [--eagle3]

Every side is a fresh process from spawn to exit, the two sides alternated, ``--repeats`` times each:
  hsx    ``hsx extract --engine vllm`` (plain greedy decoding, ``--layers final`` plus three
         boundaries): dataset, rendering, vLLM with hsx's capture, alignment, shards written;
  plain  ``vllm.LLM.generate`` over the same token ids with no capture, the same engine settings
         hsx uses (fp32, eager, prefix caching off, token ids in, the same stop tokens).
Each process reports its start-up (its imports, then ``vllm.LLM(...)``; for hsx ``VLLMRunner(...)``,
which imports vLLM itself and sets up the capture) and generation: for plain the time inside ``LLM.generate``, for hsx
the time inside ``VLLMRunner.run`` (``LLM.generate`` plus taking the captured rows and building the
samples). Completion token counts are checked equal between the sides. ``--eagle3`` adds the demo's
EAGLE3 head (3 steps, ``--layers final,eagle3``) against plain vLLM with the same speculative config.
Prints a table of hsx/plain ratios (min and median over repeats).

``--per-step`` measures what the capture adds to each engine step instead, in one process and one engine
per case (so start-up and machine load drift leave the comparison), at batch sizes ``--batches``:

    bash scripts/vllm_cpu.sh python scripts/bench_vllm.py --per-step [--batches 1,16,64] [--smollm2 DIR]

  plain  ``LLM.generate`` of untagged requests with the runner's own ``sample_tokens`` back in place;
  hsx    ``VLLMRunner.run`` of the same prompts (tagged requests, the capture installed).
The sides alternate, ``--repeats`` times each after one warm-up each; engine steps (calls of the runner's
``sample_tokens``) and completion tokens must be equal on both sides. Per engine step (medians over the
runs): plain's wall time; hsx's own work timed where it runs: in the step (the capture's wrapper less the
sampling it wraps) and after ``generate`` (taking the records, building the samples), and their sum as a
share of the plain step; and the differences of the sides' wall and process CPU times (noisier on a
shared machine, but they hold everything). Cases: the demo target plain (``--layers final,b2,b4,b6``)
and with the demo EAGLE3 head (``final,eagle3``, 3 steps); with ``--smollm2 DIR`` (a checkpoint:
``hsx.demo.pretrained.smollm2_checkpoint()``) SmolLM2-135M plain too; with ``--model DIR`` that checkpoint
only (and ``--draft HEAD``, an EAGLE3 head in vLLM's format), on ``--device`` in ``--model-dtype`` (a GPU:
``scripts/bench_gpu.sh --vllm``). Each batch also prints both sides' tokens/s (prompt + completion) and
the bytes per second of rows hsx hands on to the shard writer. With ``--write`` each hsx run's samples then go
through the pipeline's shard writer (``BackgroundSink``, default codec and lanes, fsync and manifest), timed
apart from the run, from the first ``add`` to ``close``: the raw and on-disk bytes it wrote per second, beside the
rate the capture produced them at (the writer keeps up while its raw rate is the higher).

Both modes write their numbers to ``--json`` (default ``bench_out/bench_vllm.json``): the settings, and per case
(and batch) the summary the table shows plus every run's raw measurements.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STARTED = time.perf_counter()
ROOT = Path(__file__).resolve().parents[1]
BOUNDARIES = "b2,b4,b6"
ENGINE = {"max_num_batched_tokens": 2048, "max_model_len": 1024}


# ---- the two child processes ------------------------------------------------------------------

def child_plain(spec: dict) -> dict:
    t0 = time.perf_counter()
    import vllm

    imported = time.perf_counter()
    args = {**spec["engine_args"], "model": spec["model"], "dtype": "float32", "seed": 0, "enforce_eager": True,
            **ENGINE}
    if spec.get("draft"):
        args["speculative_config"] = {"method": "eagle3", "model": spec["draft"], "num_speculative_tokens": 3}
    llm = vllm.LLM(**args)
    started = time.perf_counter()
    params = vllm.SamplingParams(max_tokens=spec["max_new"], temperature=0.0, detokenize=False,
                                 stop_token_ids=spec["stop"])
    outs = llm.generate([{"prompt_token_ids": p} for p in spec["prompts"]], params, use_tqdm=False)
    done = time.perf_counter()
    return {"import_s": imported - t0, "start_s": started - imported, "generate_s": done - started,
            "tokens": sum(len(o.outputs[0].token_ids) for o in outs)}


def child_hsx(spec: dict) -> dict:
    t0 = time.perf_counter()
    import hsx.engine.vllm.runner as engine
    from hsx.cli import app

    imported = time.perf_counter()
    timing = {"start_s": 0.0, "generate_s": 0.0}
    init, run = engine.VLLMRunner.__init__, engine.VLLMRunner.run

    def timed_init(self, cfg):
        t = time.perf_counter()
        init(self, cfg)
        timing["start_s"] += time.perf_counter() - t

    def timed_run(self, prompts):
        t = time.perf_counter()
        out = run(self, prompts)
        timing["generate_s"] += time.perf_counter() - t
        return out

    engine.VLLMRunner.__init__, engine.VLLMRunner.run = timed_init, timed_run
    argv = ["extract", "--engine", "vllm", "--model", spec["model"], "--dataset", spec["dataset"], "-o", spec["out"],
            "--device", "cpu", "--model-dtype", "float32", "--max-new-tokens", str(spec["max_new"]),
            "--batch-size", str(len(spec["prompts"])), "--quiet"]
    argv += [f"--engine-arg={k}={v}" for k, v in ENGINE.items()]
    if spec.get("draft"):
        argv += ["--layers", "final,eagle3", "--spec-algorithm", "EAGLE3", "--draft-model", spec["draft"],
                 "--spec-num-steps", "3"]
    else:
        argv += ["--layers", f"final,{BOUNDARIES}"]
    try:
        app(argv, standalone_mode=False)
    except SystemExit as e:
        if e.code:
            raise
    return {"import_s": imported - t0, **timing}


def child(side: str, spec_path: str, result_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    got = (child_hsx if side == "hsx" else child_plain)(spec)
    got["inside_s"] = time.perf_counter() - STARTED
    Path(result_path).write_text(json.dumps(got))


# ---- the parent ---------------------------------------------------------------------------------

def make_case(root: Path, models, n: int, max_new: int, draft: Path | None) -> Path:
    """The dataset, its token ids as hsx renders them, and the settings both sides read."""
    from transformers import AutoTokenizer

    from hsx.demo.tokenizer import demo_corpus
    from hsx.engine.vllm.runner import REQUIRED_ARGS

    words = demo_corpus().split()
    texts = [" ".join(words[(i * 37) % (len(words) - 80):][: 8 + (i * 13) % 72]) for i in range(n)]
    name = f"{n}x{max_new}" + ("-eagle3" if draft else "")
    dataset = root / f"{name}.jsonl"
    dataset.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    tok = AutoTokenizer.from_pretrained(models.target)
    prompts = [list(tok(t, add_special_tokens=True)["input_ids"]) for t in texts]  # as hsx's renderer does
    spec = {"model": str(models.target), "dataset": str(dataset), "prompts": prompts, "max_new": max_new,
            "stop": stop_tokens(models.target), "draft": str(draft) if draft else None, "out": "",
            "engine_args": {k: v for k, v in REQUIRED_ARGS.items() if k != "worker_extension_cls"}}
    path = root / f"{name}.json"
    path.write_text(json.dumps(spec))
    return path


def stop_tokens(model: Path) -> list[int]:
    """The eos ids hsx's engine passes as stop tokens (generation config and tokenizer)."""
    from transformers import AutoTokenizer, GenerationConfig

    stops = set()
    try:
        gen = GenerationConfig.from_pretrained(model)
    except OSError:
        gen = None
    for source in (gen, AutoTokenizer.from_pretrained(model)):
        eos = getattr(source, "eos_token_id", None)
        stops.update([eos] if isinstance(eos, int) else (eos or []))
    return sorted(stops)


def run_child(side: str, spec_path: Path, root: Path, k: int) -> dict:
    spec = json.loads(spec_path.read_text())
    spec["out"] = str(root / f"out-{spec_path.stem}-{k}")
    one = root / f"spec-{side}-{k}.json"
    one.write_text(json.dumps(spec))
    result = root / f"result-{side}-{spec_path.stem}-{k}.json"
    t = time.perf_counter()
    done = subprocess.run([sys.executable, __file__, "--child", side, str(one), str(result)],
                          check=False, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if done.returncode != 0:
        raise SystemExit(f"{side} {spec_path.stem} run {k} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    got = {**json.loads(result.read_text()), "process_s": wall}
    if side == "hsx":  # counted here, after the clock stopped
        import hsx

        got["tokens"] = sum(len(s.input_ids) - int(s.prompt_len) for s in hsx.open(spec["out"]))
    return got


def summarise(name: str, runs: dict[str, list[dict]]) -> dict:
    """The case's runs, its hsx/plain ratios per measure and their table rows."""
    tokens = {side: {r["tokens"] for r in rs} for side, rs in runs.items()}
    if tokens["hsx"] != tokens["plain"] or len(tokens["hsx"]) != 1:
        raise SystemExit(f"{name}: completion tokens differ between runs or sides: {tokens}")
    case = {"case": name, "runs": runs, "measures": {}, "rows": []}
    for side in runs.values():
        for r in side:
            r["startup_s"] = r["import_s"] + r["start_s"]
    for key, label in (("process_s", "whole process"), ("generate_s", "generation"),
                       ("startup_s", "start-up (imports + engine)")):
        h = [r[key] for r in runs["hsx"]]
        p = [r[key] for r in runs["plain"]]
        ratios = [a / b for a, b in zip(h, p, strict=True)]
        case["measures"][key] = {"hsx_min": min(h), "hsx_median": statistics.median(h), "plain_min": min(p),
                                 "plain_median": statistics.median(p), "min_over_min": min(h) / min(p),
                                 "median_ratio": statistics.median(ratios)}
        case["rows"].append(f"| {name} | {label} | {min(h):.2f} / {statistics.median(h):.2f} | "
                            f"{min(p):.2f} / {statistics.median(p):.2f} | {min(h) / min(p):.2f}x | "
                            f"{statistics.median(ratios):.2f}x |")
    return case


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="64x32,16x128", help="PROMPTSxNEW_TOKENS, comma-separated")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--eagle3", action="store_true", help="also the EAGLE3 case, at the first size")
    ap.add_argument("--child", nargs=3, metavar=("SIDE", "SPEC", "RESULT"), help=argparse.SUPPRESS)
    ap.add_argument("--per-step", action="store_true", help="hsx's added time per engine step, in one process")
    ap.add_argument("--batches", default="1,16,64", help="batch sizes of --per-step")
    ap.add_argument("--new-tokens", type=int, default=32, help="completion tokens per prompt in --per-step")
    ap.add_argument("--smollm2", help="--per-step also on this SmolLM2-135M checkpoint directory")
    ap.add_argument("--model", help="--per-step on this checkpoint only (plain, and EAGLE3 with --draft)")
    ap.add_argument("--draft", help="an EAGLE3 head in vLLM's format for --model")
    ap.add_argument("--device", default="cpu", help="--per-step device (cuda on a GPU)")
    ap.add_argument("--model-dtype", default="float32", help="--per-step compute dtype (bfloat16 on a GPU)")
    ap.add_argument("--write", action="store_true", help="--per-step: also time the shard writer on hsx's rows")
    ap.add_argument("--json", type=Path, default=ROOT / "bench_out" / "bench_vllm.json", help="where the numbers go")
    a = ap.parse_args()
    if a.child:
        child(*a.child)
        return
    if a.per_step:
        per_step_main(a)
        return
    sys.path.insert(0, str(ROOT / "scripts" / "vllm_cpu"))
    from heads import vllm_heads

    from hsx.demo.spec_models import build_spec_models

    root = Path(tempfile.mkdtemp(prefix="hsx-bench-vllm-"))
    try:
        models = build_spec_models(root / "models")
        cases = []
        for size in a.sizes.split(","):
            n, new = (int(x) for x in size.split("x"))
            cases.append(make_case(root, models, n, new, None))
        if a.eagle3:
            n, new = (int(x) for x in a.sizes.split(",")[0].split("x"))
            cases.append(make_case(root, models, n, new, vllm_heads(models)[1]))
        rows = run_cases(cases, root, a.repeats)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    header = ["| case | | hsx min / median s | plain min / median s | min/min | median of ratios |",
              "|---|---|---|---|---|---|"]
    print("\n".join(header + [row for case in rows for row in case["rows"]]))
    print(f"[bench] {os.cpu_count()} CPUs")
    write_json(a, {"mode": "whole-process", "cases": rows})


def write_json(a, results: dict) -> None:
    settings = {k: v for k, v in vars(a).items() if k not in ("child", "json")}
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps({"settings": settings, "cpus": os.cpu_count(), **results}, indent=1))
    print(f"wrote {a.json}")


def run_cases(cases: list[Path], root: Path, repeats: int) -> list[dict]:
    """Each case's sides alternated, ``repeats`` runs each; their summaries."""
    rows = []
    for case in cases:
        runs = {"hsx": [], "plain": []}
        for k in range(repeats):
            for side in ("hsx", "plain") if k % 2 == 0 else ("plain", "hsx"):
                r = run_child(side, case, root, k)
                runs[side].append(r)
                print(f"[bench] {case.stem} {side} run {k}: process {r['process_s']:.1f} s, import {r['import_s']:.1f}"
                      f" s, engine start {r['start_s']:.1f} s, generation {r['generate_s']:.2f} s, "
                      f"{r['tokens']} tokens", flush=True)
        rows.append(summarise(case.stem, runs))
    return rows


# ---- --per-step: one process, one engine per case ---------------------------------------------------

class Steps:
    """Around the model runner's own ``sample_tokens``: counts the engine steps and times them."""

    def __init__(self, inner):
        self.inner, self.count, self.seconds = inner, 0, 0.0

    def __call__(self, grammar_output):
        self.count += 1
        t = time.perf_counter()
        try:
            return self.inner(grammar_output)
        finally:
            self.seconds += time.perf_counter() - t


def _model_runner(worker):
    return worker.model_runner


def timed_capture(capture, clock: dict) -> None:
    """Times every call of hsx's capture (its own work plus the sampling it wraps) into ``clock["capture_s"]``."""
    call = type(capture).__call__

    def timed(self, grammar_output):
        t = time.perf_counter()
        try:
            return call(self, grammar_output)
        finally:
            clock["capture_s"] += time.perf_counter() - t

    capture.__class__ = type("TimedCapture", (type(capture),), {"__call__": timed})  # still the capture class


def per_step_case(label: str, model: str, draft, batches: list[int], new_tokens: int, repeats: int,
                  device: str = "cpu", model_dtype: str = "float32", write: Path | None = None) -> list[dict]:
    from transformers import AutoTokenizer

    from hsx.config import ExtractConfig
    from hsx.data.render import Prompt
    from hsx.demo.tokenizer import demo_corpus
    from hsx.engine.vllm.runner import VLLMRunner

    spec = {"layers": "final,eagle3", "spec_algorithm": "EAGLE3", "draft_model": str(draft), "spec_num_steps": 3} \
        if draft else {"layers": f"final,{BOUNDARIES}"}
    cfg = ExtractConfig(model=model, engine="vllm", device=device, model_dtype=model_dtype, dtype="bfloat16",
                        max_new_tokens=new_tokens, batch_size=max(batches), engine_args=dict(ENGINE), **spec)
    runner = VLLMRunner(cfg)
    model_runner = runner.llm.collective_rpc(_model_runner)[0]
    capture = model_runner.sample_tokens
    sampling = capture.inner  # the runner's own sample_tokens
    clock = {"generate_s": 0.0, "capture_s": 0.0}
    timed_capture(capture, clock)
    tok = AutoTokenizer.from_pretrained(model)
    words = demo_corpus().split()
    generate = runner.llm.generate

    def timed_generate(*args, **kwargs):
        t = time.perf_counter()
        out = generate(*args, **kwargs)
        clock["generate_s"] += time.perf_counter() - t
        return out

    def plain(prompts) -> dict:
        counter = model_runner.sample_tokens = Steps(sampling)
        params = runner._sampling("untagged")
        params.extra_args = None
        t, c = time.perf_counter(), time.process_time()
        outs = generate([{"prompt_token_ids": p.input_ids} for p in prompts], params, use_tqdm=False)
        return {"wall": time.perf_counter() - t, "cpu": time.process_time() - c, "steps": counter.count,
                "tokens": sum(len(o.outputs[0].token_ids) for o in outs)}

    def captured(prompts) -> dict:
        model_runner.sample_tokens = capture  # hsx's take finds it there
        counter = capture.inner = Steps(sampling)
        clock.update(generate_s=0.0, capture_s=0.0)
        runner.llm.generate = timed_generate
        try:
            t, c = time.perf_counter(), time.process_time()
            samples = runner.run(prompts)
            wall, cpu = time.perf_counter() - t, time.process_time() - c
        finally:
            del runner.llm.generate
        bad = [s for s in samples if not hasattr(s, "input_ids")]
        if bad:
            raise SystemExit(f"{label}: hsx failed a sample: {bad[0]}")
        got = {"wall": wall, "cpu": cpu, "steps": counter.count, "in_step": clock["capture_s"] - counter.seconds,
               "after": wall - clock["generate_s"],
               "tokens": sum(int(s.input_ids.numel()) - int(s.prompt_len) for s in samples),
               "bytes": sum(sum(h.numel() * h.element_size() for h in s.hidden.values()) for s in samples)}
        return got | (written(prompts, samples, write) if write else {})

    rows = []
    for b in batches:
        texts = [" ".join(words[(i * 37) % (len(words) - 80):][: 8 + (i * 13) % 72]) for i in range(b)]
        ids = [list(tok(t, add_special_tokens=True)["input_ids"]) for t in texts]
        prompts = [Prompt(f"p{i}", i, x, [1] * len(x)) for i, x in enumerate(ids)]
        plain(prompts), captured(prompts)  # warm-up
        runs = {"plain": [], "hsx": []}
        for k in range(repeats):
            for side in ("plain", "hsx") if k % 2 == 0 else ("hsx", "plain"):
                runs[side].append(plain(prompts) if side == "plain" else captured(prompts))
        summary = per_step_summary(label, b, ids, runs)
        rows.append({"case": label, "batch": b, "summary": summary, "runs": runs})
        print(f"[bench] {per_step_row(label, b, summary)}", flush=True)
        print(f"[bench] {throughput(label, b, summary)}", flush=True)
    return rows


def per_step_summary(label: str, batch: int, prompts: list[list[int]], runs: dict[str, list[dict]]) -> dict:
    """Per engine step in ms, medians over the runs: hsx's own work timed where it runs and the sides' differences;
    tokens/s (prompt + completion) of each side and the rows (bf16) hsx hands on per second."""
    steps = {r["steps"] for side in runs.values() for r in side}
    tokens = {r["tokens"] for side in runs.values() for r in side}
    if len(steps) != 1 or len(tokens) != 1:
        raise SystemExit(f"{label} batch {batch}: engine steps {steps} or completion tokens {tokens} differ between runs")
    n = steps.pop()

    def ms(side, key):
        return statistics.median(1e3 * r[key] / n for r in runs[side])

    def added(key):
        return statistics.median(1e3 * (h[key] - p[key]) / n for h, p in zip(runs["hsx"], runs["plain"], strict=True))

    total = sum(map(len, prompts)) + tokens.pop()
    plain_tok_s = statistics.median(total / r["wall"] for r in runs["plain"])
    hsx_tok_s = statistics.median(total / r["wall"] for r in runs["hsx"])
    plain_wall, in_step, after = ms("plain", "wall"), ms("hsx", "in_step"), ms("hsx", "after")
    summary = {"steps": n, "plain_ms": plain_wall, "in_step_ms": in_step, "after_ms": after,
               "own_share": (in_step + after) / plain_wall, "wall_added_ms": added("wall"),
               "plain_cpu_ms": ms("plain", "cpu"), "cpu_added_ms": added("cpu"), "plain_tokens_per_s": plain_tok_s,
               "hsx_tokens_per_s": hsx_tok_s,
               "writer_bytes_per_s": statistics.median(r["bytes"] / r["wall"] for r in runs["hsx"])}
    if "write_s" in runs["hsx"][0]:  # --write
        summary["written_raw_bytes_per_s"] = statistics.median(r["bytes"] / r["write_s"] for r in runs["hsx"])
        summary["written_disk_bytes_per_s"] = statistics.median(r["written_disk_bytes"] / r["write_s"]
                                                                for r in runs["hsx"])
    return summary


def per_step_row(label: str, batch: int, s: dict) -> str:
    return (f"| {label} | {batch} | {s['steps']} | {s['plain_ms']:.2f} | {s['in_step_ms']:.3f} | {s['after_ms']:.3f} | "
            f"{100 * s['own_share']:.1f}% | {s['wall_added_ms']:+.2f} | {s['plain_cpu_ms']:.2f} | "
            f"{s['cpu_added_ms']:+.2f} |")


def throughput(label: str, batch: int, s: dict) -> str:
    plain, hsx = s["plain_tokens_per_s"], s["hsx_tokens_per_s"]
    line = (f"{label} batch {batch}: plain {plain:,.0f} tokens/s, capture on {hsx:,.0f} tokens/s ({hsx / plain:.3f}x), "
            f"rows handed to the writer {s['writer_bytes_per_s'] / 1e6:,.1f} MB/s")
    if "written_raw_bytes_per_s" in s:
        line += (f"; the shard writer wrote them at {s['written_raw_bytes_per_s'] / 1e6:,.1f} MB/s raw, "
                 f"{s['written_disk_bytes_per_s'] / 1e6:,.1f} MB/s on disk")
    return line


def written(prompts, samples, root: Path) -> dict:
    """The samples through the pipeline's shard writer (default codec and lanes) into a fresh folder under
    ``root``: seconds from the first ``add`` to ``close``, raw record bytes and bytes on disk; the folder is removed."""
    from hsx.run.core import make_record
    from hsx.shards import BackgroundSink, Manifest, build_metadata

    layers = [{"name": name, "width": h.shape[1]} for name, h in samples[0].hidden.items()]
    meta = build_metadata(layers=layers, dtype="bfloat16", mode="generate")
    out = Path(tempfile.mkdtemp(prefix="shards-", dir=root))
    t = time.perf_counter()
    with BackgroundSink(out, Manifest(meta)) as sink:
        for prompt, sample in zip(prompts, samples, strict=True):
            sink.add(make_record(prompt, sample, "generate", "all"))
    seconds = time.perf_counter() - t
    disk = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    shutil.rmtree(out)
    return {"write_s": seconds, "written_disk_bytes": disk}


PER_STEP_HEADER = [("| case | batch | engine steps | plain ms/step | hsx in the step, ms/step | hsx after generate, ms/step"
                    " | hsx's own / plain | wall added, ms/step | plain CPU ms/step | CPU added, ms/step |"),
                   "|---|---|---|---|---|---|---|---|---|---|"]


def per_step_main(a) -> None:
    sys.path.insert(0, str(ROOT / "scripts" / "vllm_cpu"))
    from heads import vllm_heads

    from hsx.demo.spec_models import build_spec_models

    batches = [int(b) for b in a.batches.split(",")]
    root = Path(tempfile.mkdtemp(prefix="hsx-bench-vllm-"))
    try:
        if a.model:
            name = Path(a.model).name
            cases = [(f"{name} plain", a.model, None)] + ([(f"{name} EAGLE3", a.model, a.draft)] if a.draft else [])
        else:
            models = build_spec_models(root / "models")
            cases = [("demo plain", str(models.target), None),
                     ("demo EAGLE3", str(models.target), vllm_heads(models)[1])]
            if a.smollm2:
                cases.append(("SmolLM2-135M plain", a.smollm2, None))
        rows = []
        for label, model, draft in cases:
            rows += per_step_case(label, model, draft, batches, a.new_tokens, a.repeats, a.device, a.model_dtype,
                                  root if a.write else None)
            gc.collect()  # the case's engine
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print("\n".join([*PER_STEP_HEADER, *(per_step_row(r["case"], r["batch"], r["summary"]) for r in rows)]))
    print(f"[bench] {os.cpu_count()} CPUs, {a.repeats} runs a side, {a.new_tokens} new tokens a prompt")
    write_json(a, {"mode": "per-step", "cases": rows})


if __name__ == "__main__":
    main()
