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
  hsx    ``VLLMRunner.run`` of the same prompts: its time inside ``LLM.generate`` (the engine steps with the
         capture) and its whole time (taking the records and building the samples too).
The sides alternate, ``--repeats`` times each after one warm-up each; engine steps are counted (calls of
``sample_tokens``) and must be equal on both sides, as must the completion tokens. Cases: the demo target
plain (``--layers final,b2,b4,b6``) and with the demo EAGLE3 head (``final,eagle3``, 3 steps); with
``--smollm2 DIR`` (a checkpoint: ``hsx.demo.pretrained.smollm2_checkpoint()``) SmolLM2-135M plain too.
Prints ms per step (median over repeats) of each side, hsx's added ms per step (median of the runs'
differences) and that as a share of the plain step.
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
                          capture_output=True, text=True)
    wall = time.perf_counter() - t
    if done.returncode != 0:
        raise SystemExit(f"{side} {spec_path.stem} run {k} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    got = {**json.loads(result.read_text()), "process_s": wall}
    if side == "hsx":  # counted here, after the clock stopped
        import hsx

        got["tokens"] = sum(len(s.input_ids) - int(s.prompt_len) for s in hsx.open(spec["out"]))
    return got


def summarise(name: str, runs: dict[str, list[dict]]) -> list[str]:
    tokens = {side: {r["tokens"] for r in rs} for side, rs in runs.items()}
    if tokens["hsx"] != tokens["plain"] or len(tokens["hsx"]) != 1:
        raise SystemExit(f"{name}: completion tokens differ between runs or sides: {tokens}")
    lines = []
    for side in runs.values():
        for r in side:
            r["startup_s"] = r["import_s"] + r["start_s"]
    for key, label in (("process_s", "whole process"), ("generate_s", "generation"),
                       ("startup_s", "start-up (imports + engine)")):
        h = [r[key] for r in runs["hsx"]]
        p = [r[key] for r in runs["plain"]]
        ratios = [a / b for a, b in zip(h, p, strict=True)]
        lines.append(f"| {name} | {label} | {min(h):.2f} / {statistics.median(h):.2f} | "
                     f"{min(p):.2f} / {statistics.median(p):.2f} | {min(h) / min(p):.2f}x | "
                     f"{statistics.median(ratios):.2f}x |")
    return lines


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
    print("\n".join(header + rows))
    print(f"[bench] {os.cpu_count()} CPUs")


def run_cases(cases: list[Path], root: Path, repeats: int) -> list[str]:
    """Each case's sides alternated, ``repeats`` runs each; the table rows."""
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
        rows += summarise(case.stem, runs)
    return rows


# ---- --per-step: one process, one engine per case ---------------------------------------------------

class Steps:
    """Put in place of the model runner's ``sample_tokens``: counts the engine steps, then calls ``inner``."""

    def __init__(self, inner):
        self.inner, self.count = inner, 0

    def __call__(self, grammar_output):
        self.count += 1
        return self.inner(grammar_output)


def _model_runner(worker):
    return worker.model_runner


def per_step_case(label: str, model: str, draft, batches: list[int], new_tokens: int, repeats: int) -> list[str]:
    from transformers import AutoTokenizer

    from hsx.config import ExtractConfig
    from hsx.data.render import Prompt
    from hsx.demo.tokenizer import demo_corpus
    from hsx.engine.vllm.runner import VLLMRunner

    spec = {"layers": "final,eagle3", "spec_algorithm": "EAGLE3", "draft_model": str(draft), "spec_num_steps": 3} \
        if draft else {"layers": f"final,{BOUNDARIES}"}
    cfg = ExtractConfig(model=model, engine="vllm", device="cpu", model_dtype="float32", dtype="bfloat16",
                        max_new_tokens=new_tokens, batch_size=max(batches), engine_args=dict(ENGINE), **spec)
    runner = VLLMRunner(cfg)
    model_runner = runner.llm.collective_rpc(_model_runner)[0]
    capture = model_runner.sample_tokens
    tok = AutoTokenizer.from_pretrained(model)
    words = demo_corpus().split()
    inside = {"s": 0.0}
    generate = runner.llm.generate

    def timed_generate(*args, **kwargs):
        t = time.perf_counter()
        out = generate(*args, **kwargs)
        inside["s"] += time.perf_counter() - t
        return out

    def plain(prompts) -> tuple[float, int, int]:
        counter = model_runner.sample_tokens = Steps(capture.inner)
        params = runner._sampling("untagged")
        params.extra_args = None
        t = time.perf_counter()
        outs = generate([{"prompt_token_ids": p.input_ids} for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - t, counter.count, sum(len(o.outputs[0].token_ids) for o in outs)

    def captured(prompts) -> tuple[float, float, int, int]:
        counter = model_runner.sample_tokens = Steps(capture)
        inside["s"] = 0.0
        runner.llm.generate = timed_generate
        try:
            t = time.perf_counter()
            samples = runner.run(prompts)
            whole = time.perf_counter() - t
        finally:
            del runner.llm.generate
        bad = [s for s in samples if not hasattr(s, "input_ids")]
        if bad:
            raise SystemExit(f"{label}: hsx failed a sample: {bad[0]}")
        return inside["s"], whole, counter.count, sum(int(s.input_ids.numel()) - int(s.prompt_len) for s in samples)

    rows = []
    for b in batches:
        texts = [" ".join(words[(i * 37) % (len(words) - 80):][: 8 + (i * 13) % 72]) for i in range(b)]
        ids = [list(tok(t, add_special_tokens=True)["input_ids"]) for t in texts]
        prompts = [Prompt(f"p{i}", i, x, [1] * len(x)) for i, x in enumerate(ids)]
        plain(prompts), captured(prompts)  # warm-up
        p_runs, h_runs = [], []
        for k in range(repeats):
            for side in ("plain", "hsx") if k % 2 == 0 else ("hsx", "plain"):
                if side == "plain":
                    p_runs.append(plain(prompts))
                else:
                    h_runs.append(captured(prompts))
        steps = {r[1] for r in p_runs} | {r[2] for r in h_runs}
        tokens = {r[2] for r in p_runs} | {r[3] for r in h_runs}
        if len(steps) != 1 or len(tokens) != 1:
            raise SystemExit(f"{label} batch {b}: engine steps {steps} or completion tokens {tokens} differ between runs")
        n = steps.pop()
        plain_ms = [1e3 * r[0] / n for r in p_runs]
        gen_ms = [1e3 * r[0] / n for r in h_runs]
        whole_ms = [1e3 * r[1] / n for r in h_runs]
        added = statistics.median(g - q for g, q in zip(gen_ms, plain_ms, strict=True))
        added_whole = statistics.median(w - q for w, q in zip(whole_ms, plain_ms, strict=True))
        base = statistics.median(plain_ms)
        rows.append(f"| {label} | {b} | {n} | {base:.2f} | {statistics.median(gen_ms):.2f} | {added:+.2f} | "
                    f"{100 * added / base:+.1f}% | {statistics.median(whole_ms):.2f} | {added_whole:+.2f} | "
                    f"{100 * added_whole / base:+.1f}% |")
        print(f"[bench] {rows[-1]}", flush=True)
    return rows


def per_step_main(a) -> None:
    sys.path.insert(0, str(ROOT / "scripts" / "vllm_cpu"))
    from heads import vllm_heads

    from hsx.demo.spec_models import build_spec_models

    batches = [int(b) for b in a.batches.split(",")]
    root = Path(tempfile.mkdtemp(prefix="hsx-bench-vllm-"))
    try:
        models = build_spec_models(root / "models")
        cases = [("demo plain", str(models.target), None), ("demo EAGLE3", str(models.target), vllm_heads(models)[1])]
        if a.smollm2:
            cases.append(("SmolLM2-135M plain", a.smollm2, None))
        rows = []
        for label, model, draft in cases:
            rows += per_step_case(label, model, draft, batches, a.new_tokens, a.repeats)
            gc.collect()  # the case's engine
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print("\n".join(["| case | batch | engine steps | plain ms/step | hsx ms/step in generate | added ms/step | "
                     "added / plain | hsx ms/step whole run | added whole | added whole / plain |",
                     "|---|---|---|---|---|---|---|---|---|---|", *rows]))
    print(f"[bench] {os.cpu_count()} CPUs, {a.repeats} runs a side, {a.new_tokens} new tokens a prompt")


if __name__ == "__main__":
    main()
