"""`hsx extract` against what a user would write with transformers, each side a whole process.

Three comparisons, in one run, on one random-init Llama built here (no download):
  prefill      hsx extract --mode prefill --layers final (bf16 compute, bf16 rows written to shards)
               vs a bare forward: the same texts tokenized the same way, right-padded dataset-order
               batches, model(input_ids, attention_mask, output_hidden_states=True) under
               torch.inference_mode(), nothing kept;
  generate     hsx extract --mode generate (greedy, plain decoding)
               vs model.generate(..., do_sample=False, output_hidden_states=True,
               return_dict_in_generate=True) on left-padded dataset-order batches, the final-layer
               state of every position (prompt rows without padding, then each decode step's row)
               gathered to CPU per sample;
  generate-eos the same two sides on a copy of the target whose eos is reachable (completions end
               at different lengths, as real ones do): transformers keeps a batch running until its
               longest completion ends, hsx refills the finished rows (continuous batching); the
               ratio is new tokens per second, since bf16 near-ties may end a completion a token
               apart on the two sides (the counts must agree within 2%);
  speculative  hsx extract --draft-model (a perturbed copy of the target, a chain of
               --spec-num-steps) vs hsx plain decoding, same prompts and budget; the mean accept
               length is read from the output. The draft is as large as the target, so this ratio
               is the cost of draft + verify at that accept length, not what a small draft gains.

Everything runs on the CPU (scripts/bench_gpu.py is the GPU counterpart). Every side is timed as a
whole process, from spawn to exit (imports, model load, I/O included), with the same thread count
pinned on every side (OMP/MKL/Rayon threads and torch.set_num_threads). Sides alternate (the order
flips every repeat; the three generate-mode sides rotate, hsx plain serving both comparisons). The
table shows min and median wall time per side; each comparison's ratio is a speed ratio, baseline
wall time / hsx wall time (token and row counts are checked equal), from the medians and from the
minima. The eos row of the model's lm_head is zeroed,
so a greedy decoder never emits eos and every side generates exactly --max-new-tokens per prompt;
the script fails if any side's counts differ. Results go to bench_out/bench_extract.json.

    python scripts/bench_extract.py                  # 600 texts of 120-220 words, 64 prompts x 48 tokens,
                                                     # 4 blocks x hidden 512, batch 8, 3 repeats
    python scripts/bench_extract.py --quick          # tiny sizes, about a minute
    python scripts/bench_extract.py --only prefill --max-batch-tokens 4096 --hsx-arg=--keep --hsx-arg=last

--max-batch-tokens and every --hsx-arg are passed to each hsx run (only when given).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[1])
TARGETS = {"prefill": 0.97, "generate": 1.3}


# --- the baseline sides (run as `python bench_extract.py _bare-prefill|_bare-generate ...`) ---


def _load(model_dir: str, threads: int):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    return torch, tok, model


def bare_prefill(model_dir: str, data: str, batch_size: int, threads: int) -> dict:
    torch, tok, model = _load(model_dir, threads)
    texts = [json.loads(line)["text"] for line in Path(data).read_text().splitlines()]
    ids = tok(texts, add_special_tokens=True)["input_ids"]
    tokens = 0
    with torch.inference_mode():
        for start in range(0, len(ids), batch_size):
            batch = ids[start : start + batch_size]
            width = max(len(x) for x in batch)
            input_ids = torch.full((len(batch), width), tok.pad_token_id, dtype=torch.long)  # [B, T]
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            for i, x in enumerate(batch):
                input_ids[i, : len(x)] = torch.tensor(x)
                mask[i, : len(x)] = 1
            model(input_ids=input_ids, attention_mask=mask, output_hidden_states=True)
            tokens += int(mask.sum())
    return {"samples": len(ids), "tokens": tokens, "rows": tokens}


def bare_generate(model_dir: str, data: str, batch_size: int, max_new_tokens: int, threads: int) -> dict:
    torch, tok, model = _load(model_dir, threads)
    tok.padding_side = "left"
    texts = [json.loads(line)["text"] for line in Path(data).read_text().splitlines()]
    states, prompt_tokens, new_tokens = [], 0, 0
    with torch.inference_mode():
        for start in range(0, len(texts), batch_size):
            enc = tok(texts[start : start + batch_size], add_special_tokens=True, padding=True, return_tensors="pt")
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, output_hidden_states=True,
                                 return_dict_in_generate=True, pad_token_id=tok.pad_token_id)
            prompt_final = out.hidden_states[0][-1]  # [B, P, W]: the prefill step
            decode_final = torch.cat([step[-1] for step in out.hidden_states[1:]], 1)  # [B, N - 1, W]
            new = out.sequences[:, enc.input_ids.shape[1] :]  # [B, <= N]
            for i, keep in enumerate(enc.attention_mask.bool()):
                states.append(torch.cat([prompt_final[i, keep], decode_final[i]]).cpu())
                stop = (new[i] == tok.eos_token_id).nonzero()
                new_tokens += int(stop[0]) + 1 if len(stop) else new.shape[1]
            prompt_tokens += int(enc.attention_mask.sum())
    return {"samples": len(states), "prompt_tokens": prompt_tokens, "new_tokens": new_tokens,
            "rows": sum(len(s) for s in states)}


# --- the workload ---


def build_workload(work: Path, args) -> dict:
    import torch
    from transformers.utils import logging

    from hsx.demo.models import build_tiny_llama, perturbed_copy
    from hsx.demo.tokenizer import build_demo_tokenizer, demo_corpus

    logging.disable_progress_bar()
    tok = build_demo_tokenizer()
    model = build_tiny_llama(num_layers=args.blocks, hidden_size=args.hidden, vocab_size=len(tok),
                             num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                             intermediate_size=args.intermediate or 2 * args.hidden,
                             eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id)
    with torch.no_grad():
        model.lm_head.weight[tok.eos_token_id] = 0  # logit 0 never wins the argmax: no side stops early
    draft = perturbed_copy(model, args.draft_scale, seed=1)
    for name, m in (("target", model), ("draft", draft)):
        m.to(torch.bfloat16).save_pretrained(work / name)
        tok.save_pretrained(work / name)

    words = demo_corpus().split()
    gen = torch.Generator().manual_seed(0)

    def texts(n: int, lo: int, hi: int) -> list[str]:
        out = []
        for _ in range(n):
            k = int(torch.randint(lo, hi + 1, (1,), generator=gen))
            start = int(torch.randint(0, len(words) - k, (1,), generator=gen))
            out.append(" ".join(words[start : start + k]))
        return out

    files = {}
    for name, n, lo, hi in (("prefill", args.texts, args.min_words, args.max_words),
                            ("generate", args.prompts, args.prompt_min_words, args.prompt_max_words)):
        rows = [{"id": f"{name}-{i}", "text": t} for i, t in enumerate(texts(n, lo, hi))]
        files[name] = work / f"{name}.jsonl"
        files[name].write_text("".join(json.dumps(r) + "\n" for r in rows))
    if "generate-eos" in args.only:
        _stopping_target(work, model.to(torch.bfloat16), tok, files["generate"], args)
    return {"target": work / "target", "draft": work / "draft", "target-eos": work / "target-eos", **files}


def _stopping_target(work: Path, model, tok, prompts: Path, args) -> None:
    """The target with eos made reachable, so completions end at different lengths: eos's lm_head row
    becomes 1.001 x the row of a token the model emits in about half of its completions, so eos
    wins wherever that token would have."""
    import torch

    texts = [json.loads(line)["text"] for line in prompts.read_text().splitlines()][:16]
    tok.padding_side = "left"
    with torch.inference_mode():
        enc = tok(texts, padding=True, return_tensors="pt")
        out = model.generate(**enc, max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
    new = out[:, enc.input_ids.shape[1]:]
    seen = torch.zeros(len(tok), dtype=torch.long)
    for row in new:
        seen[row.unique()] += 1
    t = int((seen - len(texts) // 2).abs().argmin())
    with torch.no_grad():
        model.lm_head.weight[tok.eos_token_id] = model.lm_head.weight[t] * 1.001
    model.save_pretrained(work / "target-eos")
    tok.save_pretrained(work / "target-eos")


# --- the timed processes ---


def _env(threads: int) -> dict:
    t = str(threads)
    return {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": t, "MKL_NUM_THREADS": t, "RAYON_NUM_THREADS": t}


def timed(cmd: list[str], threads: int, what: str) -> tuple[float, str]:
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=_env(threads), capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"{what} failed (exit {p.returncode}):\n{' '.join(cmd)}\n{p.stdout[-3000:]}{p.stderr[-3000:]}")
    return wall, p.stdout


def hsx_side(args, work: Path, w: dict, mode: str, spec: bool, out_name: str, target: str = "target"):
    out = work / out_name
    cmd = [sys.executable, "-m", "hsx.cli", "extract", "--model", str(w[target]), "--dataset", str(w[mode]),
           "--id-field", "id", "--output", str(out), "--mode", mode, "--layers", "final", "--dtype", "bfloat16",
           "--model-dtype", "bfloat16", "--batch-size", str(args.batch_size), "--device", "cpu"]
    # not --quiet: the run's summary says how long the engine waited on the shard writer (its progress
    # bar goes to stderr, redrawn at most 10 times a second)
    if mode == "generate":
        cmd += ["--max-new-tokens", str(args.max_new_tokens)]
    if spec:
        cmd += ["--draft-model", str(w["draft"]), "--spec-num-steps", str(args.spec_num_steps), "--spec-topk", "1"]
    if args.max_batch_tokens is not None:
        cmd += ["--max-batch-tokens", str(args.max_batch_tokens)]
    cmd += args.hsx_arg

    def run():
        from hsx.shards.verify import inspect

        shutil.rmtree(out, ignore_errors=True)  # an existing output would be resumed, not redone
        if out.exists():
            raise SystemExit(f"cannot remove {out}: the run would resume it")
        wall, stdout = timed(cmd, args.threads, f"hsx extract ({out_name})")
        if "resumed:" in stdout:
            raise SystemExit(f"hsx extract ({out_name}) resumed an earlier output instead of running:\n{stdout}")
        waited = re.search(r"the engine waited ([0-9.]+) s", stdout)
        WRITER_BLOCKED_S.setdefault(out_name, []).append(float(waited.group(1)) if waited else float("nan"))
        s = inspect(out)
        if s["errors"]:
            raise SystemExit(f"hsx extract ({out_name}) recorded {s['errors']} input errors: {s['error_records'][:3]}")
        acc = (s.get("accept") or {}).get("mean_accept_len")
        return wall, {"samples": s["samples"], "tokens": s["tokens"], "prompt_tokens": s["prompt_tokens"],
                      "new_tokens": s["completion_tokens"], "rows": s["rows_per_column"], "mean_accept_len": acc}
    return run


WRITER_BLOCKED_S: dict[str, list[float]] = {}  # hsx output -> seconds its engine waited on the shard writer, per run


def bare_side(args, w: dict, mode: str, target: str = "target"):
    cmd = [sys.executable, __file__, f"_bare-{mode}", str(w[target]), str(w[mode]), str(args.batch_size)]
    if mode == "generate":
        cmd.append(str(args.max_new_tokens))
    cmd.append(str(args.threads))

    def run():
        wall, stdout = timed(cmd, args.threads, f"bare {mode}")
        counts = json.loads(stdout.strip().splitlines()[-1])
        if mode == "prefill":
            counts["prompt_tokens"] = counts["tokens"]
        else:
            counts["tokens"] = counts["prompt_tokens"] + counts["new_tokens"]
        return wall, counts
    return run


def measure(sides: dict, repeats: int) -> dict:
    """Run every side `repeats` times, rotating the order each repeat; walls and the last counts per side."""
    names = list(sides)
    res = {n: {"walls": [], "counts": None} for n in names}
    for rep in range(repeats):
        order = names[rep % len(names):] + names[: rep % len(names)] if len(names) > 2 else names[:: 1 - 2 * (rep % 2)]
        for n in order:
            wall, counts = sides[n]()
            if res[n]["counts"] not in (None, counts):
                raise SystemExit(f"{n}: counts changed between repeats: {res[n]['counts']} vs {counts}")
            res[n]["walls"].append(wall)
            res[n]["counts"] = counts
            print(f"  [{rep + 1}/{repeats}] {n:<22} {wall:7.2f} s", flush=True)
    for r in res.values():
        r["min_s"], r["median_s"] = min(r["walls"]), statistics.median(r["walls"])
    return res


def ratio(res: dict, baseline: str, side: str) -> dict:
    return {"ratio_median": res[baseline]["median_s"] / res[side]["median_s"],
            "ratio_min": res[baseline]["min_s"] / res[side]["min_s"]}


def check_equal(what: str, got: dict, want: dict, keys: tuple[str, ...]) -> None:
    for k in keys:
        if got[k] != want[k]:
            raise SystemExit(f"{what}: {k} differ, {got[k]} vs {want[k]} ({got} vs {want})")


def run_comparisons(args, work: Path, w: dict) -> dict:
    results = {}
    if "prefill" in args.only:
        print("prefill", flush=True)
        res = measure({"hsx extract": hsx_side(args, work, w, "prefill", False, "out_prefill"),
                       "bare forward": bare_side(args, w, "prefill")}, args.repeats)
        check_equal("prefill hsx vs bare forward", res["hsx extract"]["counts"], res["bare forward"]["counts"],
                    ("samples", "tokens", "rows"))
        results["prefill"] = {"sides": res, **ratio(res, "bare forward", "hsx extract"), "target": TARGETS["prefill"]}
    gen_sides = {}
    if "generate" in args.only or "speculative" in args.only:
        gen_sides["hsx plain"] = hsx_side(args, work, w, "generate", False, "out_plain")
    if "generate" in args.only:
        gen_sides["transformers generate"] = bare_side(args, w, "generate")
    if "speculative" in args.only:
        gen_sides["hsx speculative"] = hsx_side(args, work, w, "generate", True, "out_spec")
    if gen_sides:
        print("generate" + (" + speculative" if "speculative" in args.only else ""), flush=True)
        res = measure(gen_sides, args.repeats)
        want = {"samples": args.prompts, "new_tokens": args.prompts * args.max_new_tokens}
        for name, r in res.items():
            check_equal(f"generate: {name} vs {args.prompts} prompts x {args.max_new_tokens} new tokens",
                        r["counts"], want, ("samples", "new_tokens"))
            check_equal(f"generate: {name} vs hsx plain", r["counts"], res["hsx plain"]["counts"], ("prompt_tokens", "rows"))
        if "generate" in args.only:
            results["generate"] = {"sides": {k: res[k] for k in ("hsx plain", "transformers generate")},
                                   **ratio(res, "transformers generate", "hsx plain"), "target": TARGETS["generate"]}
        if "speculative" in args.only:
            results["speculative"] = {"sides": {k: res[k] for k in ("hsx speculative", "hsx plain")},
                                      **ratio(res, "hsx plain", "hsx speculative"),
                                      "mean_accept_len": res["hsx speculative"]["counts"]["mean_accept_len"]}
    if "generate-eos" in args.only:
        print("generate, completions ending at eos", flush=True)
        res = measure({"hsx plain": hsx_side(args, work, w, "generate", False, "out_eos", "target-eos"),
                       "transformers generate": bare_side(args, w, "generate", "target-eos")}, args.repeats)
        hsx_c, hf_c = res["hsx plain"]["counts"], res["transformers generate"]["counts"]
        check_equal("generate-eos: hsx vs transformers", hsx_c, hf_c, ("samples", "prompt_tokens"))
        # bf16 near-ties may end a completion a token apart on the two sides: throughput, not wall time
        if abs(hsx_c["new_tokens"] - hf_c["new_tokens"]) > 0.02 * hf_c["new_tokens"]:
            raise SystemExit(f"generate-eos: new tokens differ by more than 2%: {hsx_c} vs {hf_c}")
        speed = {k: res[k]["counts"]["new_tokens"] / res[k]["median_s"] for k in res}
        best = {k: res[k]["counts"]["new_tokens"] / res[k]["min_s"] for k in res}
        results["generate-eos"] = {"sides": res, "ratio_median": speed["hsx plain"] / speed["transformers generate"],
                                   "ratio_min": best["hsx plain"] / best["transformers generate"],
                                   "target": TARGETS["generate"],
                                   "mean_new_tokens": hsx_c["new_tokens"] / hsx_c["samples"]}
    for name, r in results.items():
        if "target" in r:
            r["pass"] = r["ratio_median"] >= r["target"]
    return results


def print_report(args, results: dict) -> None:
    print(f"\nrandom Llama {args.blocks} blocks x hidden {args.hidden} ({args.heads} heads, {args.kv_heads} kv), bf16, "
          f"batch {args.batch_size}, {args.threads} threads, {args.repeats} repeat(s) per side, whole processes")
    print(f"{'comparison':<12} {'side':<22} {'min s':>8} {'median s':>9} {'tokens':>9} {'new':>7} {'tok/s (med)':>12}")
    for name, r in results.items():
        for side, s in r["sides"].items():
            c = s["counts"]
            print(f"{name:<12} {side:<22} {s['min_s']:8.2f} {s['median_s']:9.2f} {c['tokens']:9,} "
                  f"{c.get('new_tokens', 0):7,} {c['tokens'] / s['median_s']:12,.0f}")
    if "speculative" in results:
        r = results["speculative"]
        acc = r["mean_accept_len"]
        print(f"\nspeculative hsx chain ({args.spec_num_steps} steps) / hsx plain = {r['ratio_median']:.2f}x "
              f"(min-based {r['ratio_min']:.2f}x), mean accept length {acc:.2f} tokens/verify step")
    labels = {"prefill": "prefill  hsx / bare forward          ", "generate": "generate hsx / transformers generate ",
              "generate-eos": "generate, ending at eos (new tok/s)  "}
    if "generate-eos" in results:
        print(f"\ngenerate-eos: completions end at eos, {results['generate-eos']['mean_new_tokens']:.1f} new tokens "
              f"per prompt on average (of {args.max_new_tokens})")
    for name, waits in WRITER_BLOCKED_S.items():
        print(f"hsx {name}: the engine waited on the shard writer {max(waits):.2f} s at most over {len(waits)} run(s) "
              "(writer_blocked_s)")
    print()
    for name in ("prefill", "generate", "generate-eos"):
        if name in results:
            r = results[name]
            print(f"{labels[name]} = {r['ratio_median']:.2f}x  (min-based {r['ratio_min']:.2f}x; target >= "
                  f"{r['target']:.2f})  {'PASS' if r['pass'] else 'FAIL'}")


QUICK = dict(blocks=2, hidden=128, heads=4, kv_heads=4, texts=24, min_words=40, max_words=80, prompts=8,
             prompt_min_words=10, prompt_max_words=30, max_new_tokens=12, repeats=1)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=f"tiny sizes (about a minute): {QUICK}; explicit flags win")
    ap.add_argument("--repeats", type=int, help="runs per side (default 3)")
    ap.add_argument("--threads", type=int, default=2, help="threads pinned on every side")
    ap.add_argument("--only", default="prefill,generate,generate-eos,speculative", help="comma-separated comparisons to run")
    ap.add_argument("--blocks", type=int)
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--heads", type=int)
    ap.add_argument("--kv-heads", type=int)
    ap.add_argument("--intermediate", type=int, help="MLP width (default 2 x hidden)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--texts", type=int, help="prefill texts (default 600)")
    ap.add_argument("--min-words", type=int)
    ap.add_argument("--max-words", type=int)
    ap.add_argument("--prompts", type=int, help="generate prompts (default 64)")
    ap.add_argument("--prompt-min-words", type=int)
    ap.add_argument("--prompt-max-words", type=int)
    ap.add_argument("--max-new-tokens", type=int)
    ap.add_argument("--spec-num-steps", type=int, default=3)
    ap.add_argument("--draft-scale", type=float, default=0.05, help="noise scale of the draft (perturbed copy)")
    ap.add_argument("--max-batch-tokens", type=int, help="passed to every hsx run")
    ap.add_argument("--hsx-arg", action="append", default=[], help="an extra hsx extract argument (repeatable; "
                                                                     "--hsx-arg=--flag for ones starting with -)")
    ap.add_argument("--work", default="bench_out/bench_extract_work", help="models, data and outputs (replaced)")
    ap.add_argument("--json", default="bench_out/bench_extract.json")
    args = ap.parse_args(argv)
    defaults = dict(blocks=4, hidden=512, heads=8, kv_heads=8, texts=600, min_words=120, max_words=220, prompts=64,
                    prompt_min_words=20, prompt_max_words=60, max_new_tokens=48, repeats=3)
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, QUICK[k] if args.quick else v)
    args.only = [x.strip() for x in args.only.split(",") if x.strip()]
    unknown = set(args.only) - {"prefill", "generate", "generate-eos", "speculative"}
    if unknown:
        ap.error(f"--only: unknown comparisons {sorted(unknown)}")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    w = build_workload(work, args)
    results = run_comparisons(args, work, w)
    print_report(args, results)
    for r in results.values():
        assert all(math.isfinite(r[k]) and r[k] > 0 for k in ("ratio_median", "ratio_min"))
    settings = {k: v for k, v in vars(args).items() if k not in ("json", "work")}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"settings": settings, "whole_process": True, **results,
                                           "writer_blocked_s": WRITER_BLOCKED_S}, indent=1))
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_bare-prefill":
        model_dir, data, bs, threads = sys.argv[2:]
        print(json.dumps(bare_prefill(model_dir, data, int(bs), int(threads))))
    elif len(sys.argv) > 1 and sys.argv[1] == "_bare-generate":
        model_dir, data, bs, new, threads = sys.argv[2:]
        print(json.dumps(bare_generate(model_dir, data, int(bs), int(new), int(threads))))
    else:
        main()
