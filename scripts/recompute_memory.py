"""Peak resident memory of `hsx verify --recompute` over one long sample: one forward against chunks.

The workload is built here (no download): a demo-style random Llama (--blocks x --hidden, --heads
attention heads sharing --kv-heads key/value heads, fp32 on the CPU, context 2 x the longest
sample) with the demo tokenizer, and for each of --tokens one plain-text sample of that many
tokens made of the demo corpus, extracted in prefill mode (`--layers LAYERS`, float32 rows,
`--prefill-chunk 1024`) into an output of its own. Each setting then runs in a fresh process:

  recompute peak   the resident set's peak during the `hsx.recompute.recompute()` call above the
                   resident set when it started (reset there through /proc/self/clear_refs): what
                   the forward, its cache and masks, the stored rows read and the comparison cost,
                   the libraries and the shards' metadata aside (the model is loaded inside the call)
  process peak     the whole process's peak (VmHWM in /proc/self/status), imports included

Settings: "one forward" (`chunk="off"`: the sample in one teacher-forced forward, as before
chunks existed) and "chunk N" for each N of --chunks (the sample N tokens at a time through a KV
cache; `auto`: the chunk `--recompute-chunk auto` takes for that length). Every setting must check
the same rows and pass. --reuse keeps the model and outputs of an earlier run in --work. Results go to bench_out/recompute_memory.json.

    python scripts/recompute_memory.py                                  # 8K, 32K and 128K tokens
    python scripts/recompute_memory.py --tokens 8192 --chunks 256,2048 --layers final,eagle3
    python scripts/recompute_memory.py --quick                          # 1024 tokens: a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise SystemExit(f"/proc/self/status has no {key}: this script needs Linux")


class PeakMeter:
    """The resident set's peak over a stretch of this process, above the resident set at its start."""

    def __enter__(self) -> "PeakMeter":
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        self.start = _status_kib("VmRSS")
        return self

    def __exit__(self, *exc) -> None:
        self.above_mib = (_status_kib("VmHWM") - self.start) / 1024


# --- one setting (run as `python recompute_memory.py _run OUT CHUNK THREADS`) ---


def child(argv: list[str]) -> None:
    out, chunk, threads = argv
    import torch

    torch.set_num_threads(int(threads))
    import hsx
    from hsx.recompute import recompute

    ds = hsx.open(out)
    # the libraries' first use (imports, kernels) outside the measured call: one small forward of the model
    from transformers import AutoModelForCausalLM, DynamicCache

    warm = AutoModelForCausalLM.from_pretrained(ds.metadata["model"]["path"], dtype=torch.float32,
                                                attn_implementation="sdpa").eval()
    with torch.inference_mode():
        cache = DynamicCache(config=warm.config)
        for _ in range(2):
            warm.model(input_ids=torch.zeros(1, 8, dtype=torch.long), cache=cache, use_cache=True,
                       output_hidden_states=True)
    del warm, cache
    t0 = time.perf_counter()
    with PeakMeter() as meter:
        report = recompute(out, chunk="off" if chunk == "-" else chunk if chunk == "auto" else int(chunk),
                           progress=False)
    print(json.dumps({"ok": report.ok, "rows": report.rows, "row_checks": report.row_checks,
                      "sample_tokens": report.tokens, "chunked_samples": report.chunked_samples,
                      "worst_rel": max(s.worst_rel for s in report.sources), "findings": len(report.findings),
                      "recompute_peak_mib": meter.above_mib, "seconds": time.perf_counter() - t0,
                      "process_peak_mib": _status_kib("VmHWM") / 1024, "samples": len(ds)}))


# --- the workload and the table ---


def build_model(work: Path, args, context: int) -> str:
    from hsx.demo.models import build_tiny_llama
    from hsx.demo.tokenizer import build_demo_tokenizer

    tok = build_demo_tokenizer()
    model = build_tiny_llama(num_layers=args.blocks, hidden_size=args.hidden, vocab_size=len(tok),
                             num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                             max_position_embeddings=context, eos_token_id=tok.eos_token_id,
                             bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id)
    model.save_pretrained(work / "target")
    tok.save_pretrained(work / "target")
    return str(work / "target")


def long_text(model_dir: str, tokens: int) -> str:
    """The demo corpus again and again, the fewest words that reach ``tokens`` tokens."""
    from transformers import AutoTokenizer

    from hsx.demo.tokenizer import demo_corpus

    tok = AutoTokenizer.from_pretrained(model_dir)
    words = demo_corpus().split()
    text, n = [], 0
    while n < tokens:
        text += words
        n = len(tok(" ".join(text))["input_ids"])
    lo, hi = 1, len(text)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if len(tok(" ".join(text[:mid]))["input_ids"]) < tokens else (lo, mid)
    return " ".join(text[:lo])


def build_output(work: Path, model_dir: str, tokens: int, layers: str, threads: int, reuse: bool) -> Path:
    data, out = work / f"long-{tokens}.jsonl", work / f"out-{tokens}"
    if reuse and (out / ".hsx-manifest.json").is_file():
        return out
    data.write_text(json.dumps({"id": f"long-{tokens}", "text": long_text(model_dir, tokens)}) + "\n")
    code = ("import sys, torch, hsx; torch.set_num_threads(int(sys.argv[5])); "
            "hsx.extract(hsx.ExtractConfig(model=sys.argv[1], dataset=sys.argv[2], output=sys.argv[3], mode='prefill', "
            "layers=sys.argv[4], dtype='float32', model_dtype='float32', batch_size=1, prefill_chunk=1024), "
            "progress=False, overwrite=True)")
    subprocess.run([sys.executable, "-c", code, model_dir, str(data), str(out), layers, str(threads)], check=True,
                   env=_env(threads), cwd=ROOT)
    return out


def _env(threads: int) -> dict:
    t = str(threads)
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": t, "MKL_NUM_THREADS": t}


def measure(out: Path, chunk: int | str | None, threads: int) -> dict:
    p = subprocess.run([sys.executable, str(Path(__file__).resolve()), "_run", str(out),
                        "-" if chunk is None else str(chunk), str(threads)],
                       env=_env(threads), capture_output=True, text=True, cwd=ROOT)
    if p.returncode != 0:
        raise SystemExit(f"recompute of {out} (chunk {chunk}) failed (exit {p.returncode}):\n"
                         f"{p.stdout[-3000:]}{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="8192,32768,131072", help="comma-separated sample lengths")
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=1)
    ap.add_argument("--layers", default="final", help="--layers of the extraction, hence the recompute's columns")
    ap.add_argument("--chunks", default="512,2048,auto", help="comma-separated recompute chunk sizes, or auto")
    ap.add_argument("--skip-one-forward-above", type=int, default=None,
                    help="measure the one-forward setting only up to this many tokens")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reuse", action="store_true", help="keep outputs already in --work (same model and --layers)")
    ap.add_argument("--quick", action="store_true", help="1024 tokens, chunk 256")
    ap.add_argument("--work", type=Path, default=ROOT / "bench_out" / "recompute_memory_work")
    ap.add_argument("--json", type=Path, default=ROOT / "bench_out" / "recompute_memory.json")
    args = ap.parse_args()
    if args.quick:
        args.tokens, args.chunks = "1024", "256"
    lengths = [int(t) for t in args.tokens.split(",") if t.strip()]
    chunks = [c.strip() if c.strip() == "auto" else int(c) for c in args.chunks.split(",") if c.strip()]
    args.work.mkdir(parents=True, exist_ok=True)
    model_dir = str(args.work / "target") if args.reuse and (args.work / "target").is_dir() else \
        build_model(args.work, args, 2 * max(lengths))
    results = []
    for tokens in lengths:
        out = build_output(args.work, model_dir, tokens, args.layers, args.threads, args.reuse)
        settings = [] if args.skip_one_forward_above and tokens > args.skip_one_forward_above else [None]
        for chunk in settings + chunks:
            if chunk == "auto":
                from hsx.recompute import chunk_for

                name = f"auto ({chunk_for('auto', tokens)})"
            else:
                name = "one forward" if chunk is None else f"chunk {chunk}"
            r = {"tokens": tokens, "setting": name, **measure(out, chunk, args.threads)}
            if not r["ok"] or r["findings"]:
                raise SystemExit(f"the recompute did not pass: {r}")
            results.append(r)
            print(f"  {tokens} tokens, {r['setting']}: recompute peak {r['recompute_peak_mib']:.0f} MiB, "
                  f"{r['seconds']:.1f} s", file=sys.stderr, flush=True)
        rows = {r["rows"] for r in results if r["tokens"] == tokens}
        if len(rows) != 1 or not rows:
            raise SystemExit(f"the settings checked different row counts at {tokens} tokens: {rows}")

    print(f"recompute of one prefill sample, {args.blocks} blocks x hidden {args.hidden} ({args.heads} heads, "
          f"{args.kv_heads} kv), --layers {args.layers}, fp32 on the CPU, {args.threads} thread(s)")
    print(f"{'tokens':>8} {'setting':<13}{'recompute peak MiB':>20}{'x one forward':>15}{'process peak MiB':>18}"
          f"{'seconds':>9}{'worst rel':>11}")
    for r in results:
        base = next((b for b in results if b["tokens"] == r["tokens"] and b["setting"] == "one forward"), None)
        ratio = f"{r['recompute_peak_mib'] / base['recompute_peak_mib']:.2f}" if base else "-"
        print(f"{r['tokens']:>8} {r['setting']:<13}{r['recompute_peak_mib']:>20.0f}{ratio:>15}"
              f"{r['process_peak_mib']:>18.0f}{r['seconds']:>9.1f}{r['worst_rel']:>11.2e}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results}, indent=1))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_run":
        child(sys.argv[2:])
    else:
        main()
