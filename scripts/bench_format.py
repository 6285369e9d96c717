"""Benchmark the hsx shard format against the usual ways of storing hidden states, in one run.

Every method stores the same [T, W] bfloat16 tensors:

  raw        one flat file, ``ndarray.tofile`` per sample, then fsync (the speed of light)
  hsx        ``ShardSink`` with a real manifest (fsync, rename, checksum included), codec ``none``
  hsx-zstd   the same with codec ``zstd`` (Parquet zstd pages over the raw rows)
  hsx-planes the same with codec ``planes-zstd`` (the default: byte planes + zstd), one lane
  ckpt       one ``torch.save`` file per sample, ``{input_ids, loss_mask, hidden_state [1, T, W]}``
             (SpecForge's offline layout), read with ``torch.load(weights_only=True)``; no fsync
  list       ``tensor.float().tolist()`` -> ``list<list<float32>>`` Arrow column -> Parquet; no fsync.
             20-50x slower, so it runs on a subset and its MB/s are over that subset's bytes.

Reads go to torch and touch every sample: one element of each sample's [T, W] tensor is summed,
and the sums must agree across methods (they are all bit-exact). Sizes and compression ratios
are also measured on hidden states with more structure than random normals, including the
output of a small randomly initialised Llama (no download), and on real states: SmolLM2-135M
(hsx.demo.pretrained) run by ``hsx extract`` over the demo chats with each codec, which prints
``default codec: X.XXx raw, write Y MB/s/core, engine waited Z s``.

    python scripts/bench_format.py                      # ~300 MB, prints a table, writes bench_out/bench_format.json
    python scripts/bench_format.py --mb 1000 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hsx  # noqa: E402
from hsx.shards import Manifest, Record, ShardSink, build_metadata  # noqa: E402

MB = 1e6
ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- data


def row_counts(mb: float, width: int, samples: int | None, rng: np.random.Generator) -> np.ndarray:
    """Rows per sample: uniform in [m/3, 5m/3] (100-500 for m = 300) so that the total is about ``mb``."""
    if samples is None:
        mean = 300
        samples = max(1, round(mb * MB / (mean * width * 2)))
    else:
        mean = max(3, round(mb * MB / (samples * width * 2)))
    return rng.integers(max(1, mean // 3), 5 * mean // 3 + 1, size=samples)


def normal_states(rows: np.ndarray, width: int, gen: torch.Generator) -> list[torch.Tensor]:
    return [torch.randn(int(t), width, generator=gen).bfloat16() for t in rows]


def structured_states(rows: np.ndarray, width: int, gen: torch.Generator) -> list[torch.Tensor]:
    """Hidden states shaped like a trained model's: log-normal per-feature scales, per-token norms
    that vary, and a few massive-activation channels that are large everywhere and huge on token 0."""
    feature_scale = torch.exp(0.75 * torch.randn(width, generator=gen))  # [W]
    massive = torch.randperm(width, generator=gen)[:4]
    massive_value = 200 + 400 * torch.rand(4, generator=gen)
    out = []
    for t in rows:
        x = torch.randn(int(t), width, generator=gen) * feature_scale  # [T, W]
        x *= torch.exp(0.25 * torch.randn(int(t), 1, generator=gen))
        x[:, massive] += massive_value * (1 + 0.05 * torch.randn(int(t), 4, generator=gen))
        x[0, massive] *= 8
        out.append(x.bfloat16())
    return out


def llama_states(rows: np.ndarray, width: int, seed: int) -> dict[str, list[torch.Tensor]]:
    """Final-norm output and last-block residual of a small random-init Llama over random token ids."""
    from transformers import LlamaConfig, LlamaModel

    torch.manual_seed(seed)
    heads = max(1, width // 128)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=width, intermediate_size=(width * 11 // 4 + 63) // 64 * 64,
                      num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=heads,
                      max_position_embeddings=int(rows.max()) + 1)
    model = LlamaModel(cfg).eval()
    final, residual = [], []
    with torch.no_grad():
        for t in rows:
            ids = torch.randint(0, cfg.vocab_size, (1, int(t)))
            hs = model(input_ids=ids, output_hidden_states=True).hidden_states
            final.append(hs[-1][0].bfloat16())  # [T, W], after the final norm
            residual.append(hs[-2][0].bfloat16())  # [T, W], output of the last block before the norm
    return {"llama-final": final, "llama-residual": residual}


def nbytes(states: list[torch.Tensor]) -> int:
    return sum(h.numel() * h.element_size() for h in states)


def bits(h: torch.Tensor) -> np.ndarray:
    return h.view(torch.int16).numpy()


def checksum(values) -> float:
    return float(sum(float(v) for v in values))


# ---------------------------------------------------------------- methods
# Each writer stores ``states`` under ``path`` and returns the paths it wrote; each reader returns
# the checksum of one element per sample, read back as a torch tensor.


def write_raw(states, path: Path):
    with open(path, "wb") as f:
        for h in states:
            bits(h).tofile(f)
        f.flush()
        os.fsync(f.fileno())


def read_raw(path: Path, rows: np.ndarray, width: int) -> float:
    flat = torch.from_numpy(np.fromfile(path, dtype=np.int16)).view(torch.bfloat16).view(-1, width)  # [sum T, W]
    starts = np.concatenate([[0], np.cumsum(rows)[:-1]])
    return checksum(flat[int(s)][0] for s in starts)


def write_hsx(states, path: Path, compression: str = "none"):
    meta = build_metadata(layers=[{"name": "final", "width": states[0].shape[1]}], dtype="bfloat16", mode="prefill",
                          codec=compression)
    with ShardSink(path, Manifest(meta)) as sink:
        for i, h in enumerate(states):
            n = h.shape[0]
            sink.add(Record(f"s{i}", i, torch.arange(n, dtype=torch.int32), 1, torch.ones(n, dtype=torch.uint8),
                            "length", {"final": h}))


def read_hsx(path: Path) -> float:
    return checksum(s.hidden("final")[0, 0] for s in hsx.open(path))


def read_hsx_tokens(path: Path) -> float:
    tm = hsx.open(path).tokens("final")
    first = torch.ones(len(tm.position), dtype=torch.bool) if len(tm.position) == 0 else tm.position == 0
    return checksum(tm.hidden[first, 0].tolist())


def write_ckpt(states, path: Path):
    path.mkdir()
    for i, h in enumerate(states):
        n = h.shape[0]
        torch.save({"input_ids": torch.arange(n), "loss_mask": torch.ones(n, dtype=torch.long),
                    "hidden_state": h.unsqueeze(0)}, path / f"data_{i}.ckpt")


def read_ckpt(path: Path, count: int) -> float:
    return checksum(torch.load(path / f"data_{i}.ckpt", weights_only=True)["hidden_state"][0, 0, 0] for i in range(count))


def write_list(states, path: Path):
    hidden = pa.array([h.float().tolist() for h in states], pa.list_(pa.list_(pa.float32())))
    ids = pa.array([list(range(h.shape[0])) for h in states], pa.list_(pa.int32()))
    pq.write_table(pa.table({"input_ids": ids, "hidden_state": hidden}), path, compression="none")


def read_list(path: Path) -> float:
    col = pq.read_table(path).column("hidden_state").combine_chunks()  # list<list<float32>>
    rows_off = col.offsets.to_numpy()
    inner = col.values
    flat = torch.from_numpy(inner.values.to_numpy(zero_copy_only=False).copy())  # every float, row-major
    width = len(inner[0]) if len(inner) else 0
    total = []
    for i in range(len(col)):
        h = flat[rows_off[i] * width:rows_off[i + 1] * width].view(-1, width).bfloat16()  # [T, W]
        total.append(h[0, 0])
    return checksum(total)


# ---------------------------------------------------------------- measurement


def drop_page_cache() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def settle_memory(nbytes: int) -> None:
    """Touch and free ``nbytes`` of memory right before a timed step.

    Some VMs (Firecracker and others with free-page reporting) hand memory that has been free for
    about two seconds back to the host; the next first touch of it then costs milliseconds per MB,
    which would be charged to whichever method happens to allocate first. Touching it here puts
    host-backed pages back on the free lists, as on an ordinary machine. It is never timed.
    """
    if nbytes > 0:
        block = np.empty(nbytes, dtype=np.uint8)
        block[::4096] = 1
        del block


def disk_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


SETTLE_BYTES = 0


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    settle_memory(SETTLE_BYTES)
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


class Method:
    def __init__(self, name, write, read, states, note, rows, subset=False):
        self.name, self.write, self.read, self.states, self.note, self.rows, self.subset = name, write, read, states, note, rows, subset
        self.raw_bytes = nbytes(states)
        self.write_s: list[float] = []
        self.read_s: list[float] = []
        self.cold_read_s: float | None = None
        self.disk = 0
        self.sum = None


def run_methods(methods: list[Method], work: Path, repeats_w: int, repeats_r: int, cold: bool) -> None:
    # Writes are interleaved across methods and every output but the last is deleted, so each
    # method writes under the same memory and page-cache conditions.
    for rep in range(repeats_w):
        for m in methods:
            if m.write is None:  # reads another method's output
                continue
            out = work / f"{m.name}-{rep}"
            m.write_s.append(timed(lambda: m.write(m.states, out))[0])
            m.disk = disk_bytes(out)
            if rep < repeats_w - 1:
                shutil.rmtree(out) if out.is_dir() else out.unlink()
            else:
                m.path = out
    for m in methods:
        if m.write is None:
            m.path, m.disk = methods[methods.index(m) - 1].path, methods[methods.index(m) - 1].disk
    for _ in range(repeats_r):
        for m in methods:
            seconds, m.sum = timed(lambda: m.read(m.path))
            m.read_s.append(seconds)
    if cold:
        for m in methods:
            drop_page_cache()
            m.cold_read_s = timed(lambda: m.read(m.path))[0]


def rate(m: Method, seconds: float | None) -> float | None:
    return None if not seconds else m.raw_bytes / MB / seconds


# ---------------------------------------------------------------- report


def fmt_num(x, spec=".0f"):
    return "-" if x is None else format(x, spec)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=300, help="raw bf16 megabytes of the main data set")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--samples", type=int, default=None, help="default: as many 100-500-row samples as fit in --mb")
    ap.add_argument("--out", type=Path, default=ROOT / "bench_out", help="a temp directory is made (and removed) in here")
    ap.add_argument("--json", type=Path, default=ROOT / "bench_out" / "bench_format.json")
    ap.add_argument("--list-frac", type=float, default=0.03, help="fraction of samples for the nested-list path")
    ap.add_argument("--write-repeats", type=int, default=2)
    ap.add_argument("--read-repeats", type=int, default=3)
    ap.add_argument("--llama-samples", type=int, default=24, help="samples for the random-Llama compression figure (0: skip)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-settle", action="store_true", help="do not pre-touch memory before each timed step (see settle_memory)")
    ap.add_argument("--no-real", dest="real", action="store_false", help="skip the SmolLM2 real-state section")
    args = ap.parse_args(argv)

    t_start = time.perf_counter()
    load = os.getloadavg()[0]
    rng = np.random.default_rng(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    rows = row_counts(args.mb, args.width, args.samples, rng)
    states = structured_states(rows, args.width, gen)
    n_list = max(2, round(len(states) * args.list_frac))
    global SETTLE_BYTES
    SETTLE_BYTES = 0 if args.no_settle else 2 * nbytes(states)
    print(f"data: {len(states)} samples of {rows.min()}-{rows.max()} rows x W={args.width} bf16, "
          f"{nbytes(states) / MB:.0f} MB raw (structured synthetic; see --help)")

    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-format-", dir=args.out))
    cold = drop_page_cache()
    try:
        methods = [
            Method("raw", write_raw, lambda p: read_raw(p, rows, args.width), states, "tofile + fsync; np.fromfile -> torch", rows),
            Method("hsx", write_hsx, read_hsx, states, "ShardSink (fsync, manifest); hsx.open, s.hidden()", rows),
            Method("hsx tokens()", None, read_hsx_tokens, states, "the hsx shards above; ds.tokens('final')", rows),
            Method("hsx-zstd", lambda s, p: write_hsx(s, p, "zstd"), read_hsx, states, "codec zstd; s.hidden()", rows),
            Method("hsx-planes", lambda s, p: write_hsx(s, p, "planes-zstd"), read_hsx, states,
                   "codec planes-zstd (default), one lane; s.hidden()", rows),
            Method("ckpt", write_ckpt, lambda p: read_ckpt(p, len(states)), states, "torch.save per sample, no fsync; torch.load", rows),
            Method("list (subset)", write_list, read_list, states[:n_list],
                   f"tolist -> list<list<float32>> Parquet, no fsync; {n_list} samples ({100 * n_list / len(states):.1f}%)", rows[:n_list], subset=True),
        ]
        run_methods(methods, work, args.write_repeats, args.read_repeats, cold)
        compression = compression_table(states, rows, args, gen, work)
        real = real_states(work) if args.real else None
    finally:
        shutil.rmtree(work, ignore_errors=True)

    report = build_report(methods, compression, args, cold, len(states), rows, time.perf_counter() - t_start)
    report["environment"]["load_avg_1min_at_start"] = load
    report["real_states"] = real
    print_report(report)
    if real:
        print_real(real)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1))
    print(f"\nJSON: {args.json}")
    return 0


def compression_table(states, rows, args, gen, work: Path) -> list[dict]:
    """Bytes on disk of hsx and hsx-zstd per data kind (sizes only; speeds are in the main table)."""
    k = max(1, len(states) // 5)
    kinds = {"normal (random N(0,1))": normal_states(rows[:k], args.width, gen),
             "structured synthetic": states}
    if args.llama_samples:
        kinds.update({f"{name} (random-init, 2 layers)": s for name, s in
                      llama_states(rows[:args.llama_samples], args.width, args.seed).items()})
    out = []
    for kind, data in kinds.items():
        sizes = {}
        for comp in ("none", "zstd", "planes-zstd"):
            path = work / f"kind-{len(out)}-{comp}"
            seconds = timed(lambda: write_hsx(data, path, comp))[0]
            sizes[comp] = (disk_bytes(path), seconds)
            shutil.rmtree(path)
        raw = nbytes(data)
        out.append({"kind": kind, "samples": len(data), "raw_mb": raw / MB,
                    "hsx_ratio_to_raw": sizes["none"][0] / raw, "zstd_ratio_to_raw": sizes["zstd"][0] / raw,
                    "zstd_smaller_by": raw / sizes["zstd"][0], "zstd_write_mb_s": raw / MB / sizes["zstd"][1],
                    "planes_ratio_to_raw": sizes["planes-zstd"][0] / raw})
    return out


def build_report(methods, compression, args, cold, samples, rows, elapsed) -> dict:
    by = {m.name: m for m in methods}
    raw, h, ck = by["raw"], by["hsx"], by["ckpt"]
    res = {}
    for m in methods:
        res[m.name] = {
            "note": m.note, "subset": m.subset, "samples": len(m.states), "raw_mb": m.raw_bytes / MB,
            "disk_mb": m.disk / MB, "disk_ratio_to_raw": m.disk / m.raw_bytes,
            "write_mb_s_best": rate(m, min(m.write_s, default=None)),
            "write_mb_s_median": rate(m, statistics.median(m.write_s) if m.write_s else None),
            "read_mb_s_best": rate(m, min(m.read_s)), "read_mb_s_median": rate(m, statistics.median(m.read_s)),
            "read_mb_s_cold": rate(m, m.cold_read_s), "write_s": m.write_s, "read_s": m.read_s, "checksum": m.sum,
        }
    best = lambda name, key: res[name][key]
    targets = [
        ("on-disk hsx <= 1.02x raw", res["hsx"]["disk_ratio_to_raw"], "<=", 1.02),
        ("write hsx >= 0.5x raw write", best("hsx", "write_mb_s_best") / best("raw", "write_mb_s_best"), ">=", 0.5),
        ("read hsx >= 0.5x raw read", best("hsx", "read_mb_s_best") / best("raw", "read_mb_s_best"), ">=", 0.5),
        ("read hsx >= 5x ckpt read", best("hsx", "read_mb_s_best") / best("ckpt", "read_mb_s_best"), ">=", 5.0),
    ]
    real = [c for c in compression if not c["kind"].startswith("normal")]
    if real:
        c = max(real, key=lambda c: c["zstd_smaller_by"])
        targets.append((f"zstd >= 1.15x smaller on real-looking data (best: {c['kind']})", c["zstd_smaller_by"], ">=", 1.15))
    sums = {m.name: m.sum for m in methods if not m.subset}
    return {
        "config": {"mb": args.mb, "width": args.width, "samples": samples, "rows_min": int(rows.min()),
                   "rows_max": int(rows.max()), "list_frac": args.list_frac, "write_repeats": args.write_repeats,
                   "read_repeats": args.read_repeats, "seed": args.seed},
        "environment": {"python": platform.python_version(), "torch": torch.__version__, "pyarrow": pa.__version__,
                        "numpy": np.__version__, "hsx": hsx.__version__, "cpus": os.cpu_count(),
                        "page_cache_dropped_for_cold_reads": cold, "memory_settled_before_each_step": SETTLE_BYTES > 0},
        "methods": res,
        "checksums_agree": len(set(sums.values())) == 1,
        "compression": compression,
        "targets": [{"target": t, "value": v, "op": op, "threshold": th,
                     "pass": v <= th if op == "<=" else v >= th} for t, v, op, th in targets],
        "elapsed_s": elapsed,
    }


def print_report(r: dict) -> None:
    res = r["methods"]
    raw_w, raw_r = res["raw"]["write_mb_s_best"], res["raw"]["read_mb_s_best"]
    ck_r = res["ckpt"]["read_mb_s_best"]
    print(f"\n{'method':<15}{'MB disk':>9}{'x raw':>7}{'write MB/s':>12}{'x raw':>7}{'read MB/s':>11}{'x raw':>7}"
          f"{'x ckpt':>8}{'cold MB/s':>11}   how")
    for name, m in res.items():
        w, rd = m["write_mb_s_best"], m["read_mb_s_best"]
        print(f"{name:<15}{m['disk_mb']:>9.1f}{m['disk_ratio_to_raw']:>7.3f}{fmt_num(w):>12}{fmt_num(w and w / raw_w, '.2f'):>7}"
              f"{rd:>11.0f}{rd / raw_r:>7.2f}{rd / ck_r:>8.1f}{fmt_num(m['read_mb_s_cold']):>11}   {m['note']}")
    print("MB/s = raw bf16 bytes / seconds; write: best of "
          f"{r['config']['write_repeats']}, read: best of {r['config']['read_repeats']} (medians in the JSON). "
          "Only raw and hsx fsync; ckpt and list do not.")
    if r["environment"]["page_cache_dropped_for_cold_reads"]:
        print("read MB/s: warm page cache for every method; cold: one read after dropping the page cache "
              "(a VM's host may still cache the disk).")
    else:
        print("The page cache could not be dropped: every read is from the page cache, for every method alike.")
    if r["environment"]["memory_settled_before_each_step"]:
        print("Before each timed step, 2x the data size of memory is touched and freed, untimed (see settle_memory).")
    load, cpus = r["environment"].get("load_avg_1min_at_start", 0), r["environment"]["cpus"]
    if load > 0.5 * cpus:
        print(f"WARNING: load average {load:.1f} on {cpus} CPUs when the run started: other processes share the CPUs, "
              "so timings are noisy (best-of-N reduces, not removes, this).")
    print(f"checksums of one element per sample agree across full-data methods: {r['checksums_agree']}")
    print(f"\n{'data kind':<44}{'samples':>8}{'raw MB':>8}{'hsx x raw':>11}{'zstd x raw':>12}{'zstd smaller by':>17}"
          f"{'zstd write MB/s':>17}{'planes x raw':>14}")
    for c in r["compression"]:
        print(f"{c['kind']:<44}{c['samples']:>8}{c['raw_mb']:>8.1f}{c['hsx_ratio_to_raw']:>11.3f}"
              f"{c['zstd_ratio_to_raw']:>12.3f}{c['zstd_smaller_by']:>16.3f}x{c['zstd_write_mb_s']:>17.0f}"
              f"{c['planes_ratio_to_raw']:>14.3f}")
    print()
    for t in r["targets"]:
        print(f"{'PASS' if t['pass'] else 'FAIL'}  {t['target']}: {t['value']:.3f} (needs {t['op']} {t['threshold']})")
    print(f"elapsed {r['elapsed_s']:.0f} s")


# ---------------------------------------------------------------- real states


REAL_LAYERS = "final,eagle3"


def column_bytes(out: Path, names: list[str]) -> dict[str, int]:
    """Compressed bytes of each named column over every committed shard (Parquet footers)."""
    total = dict.fromkeys(names, 0)
    for e in hsx.shards.load_manifest(out).shards:
        md = pq.ParquetFile(out / e.file).metadata
        for k in range(md.num_row_groups):
            for c in range(md.num_columns):
                col = md.row_group(k).column(c)
                name = col.path_in_schema.split(".")[0]
                if name in total:
                    total[name] += col.total_compressed_size
    return total


def real_states(work: Path) -> dict:
    """SmolLM2-135M over the demo chats (prefill) through ``hsx extract``, once per codec: bytes on disk of
    the hidden columns against raw bf16, the engine's wait on the writer; then the shards' states written
    again through one lane (MB/s per core) and read back (MB/s, against the raw layout)."""
    from hsx.config import ExtractConfig
    from hsx.demo.pretrained import smollm2_checkpoint
    from hsx.run.pipeline import extract

    model = smollm2_checkpoint()
    data = ROOT / "hsx" / "demo_data" / "prompts.jsonl"
    runs = {}
    for codec in ("none", "zstd", "planes-zstd"):
        out = work / f"real-{codec}"
        cfg = ExtractConfig(model=str(model), dataset=str(data), output=str(out), mode="prefill", layers=REAL_LAYERS,
                            compression=codec, id_field="id").validate()
        summary = extract(cfg, overwrite=True, progress=False)
        ds = hsx.open(out)
        raw = sum(s.num_rows * g["row_bytes"] for s in ds for g in ds.metadata["layers"])
        per_col = column_bytes(out, ds.columns)
        hidden = sum(per_col.values())
        col_raw = {g["name"]: sum(s.num_rows for s in ds) * g["row_bytes"] for g in ds.metadata["layers"]}
        runs[codec] = {"raw_hidden_bytes": raw, "hidden_bytes": hidden, "ratio_to_raw": hidden / raw,
                       "files_bytes": summary.bytes, "tokens": summary.tokens,
                       "per_column_ratio": {n: per_col[n] / col_raw[n] for n in ds.columns},
                       "engine_waited_s": summary.writer_blocked_s, "writer_busy_s": summary.writer_busy_s}
    ds = hsx.open(work / "real-none")
    records = [Record(s.sample_id, s.source_index, s.input_ids.long(), s.prompt_len, s.loss_mask.clone(), s.finish_reason,
                      {n: s.hidden(n).clone() for n in ds.columns}) for s in ds]
    raw = sum(h.numel() * 2 for r in records for h in r.hidden.values())
    speed = {}
    for codec in ("none", "planes-zstd"):
        meta = {**ds.metadata, "codec": codec}
        best_w = best_r = float("inf")
        for rep in range(3):
            path = work / f"real-speed-{codec}-{rep}"
            t = time.perf_counter()
            with ShardSink(path, Manifest(meta), lanes=1) as sink:
                for r in records:
                    sink.add(r)
            best_w = min(best_w, time.perf_counter() - t)
            t = time.perf_counter()
            total = 0.0
            for s in hsx.open(path):
                for n in ds.columns:
                    total += float(s.hidden(n)[0, 0]) if s.num_rows else 0.0
            best_r = min(best_r, time.perf_counter() - t)
        speed[codec] = {"write_mb_s_one_lane": raw / MB / best_w, "read_mb_s": raw / MB / best_r}
    return {"model": "SmolLM2-135M-Instruct (hsx.demo.pretrained)", "data": "hsx/demo_data/prompts.jsonl, prefill",
            "layers": REAL_LAYERS, "codecs": runs, "speed": speed}


def print_real(r: dict) -> None:
    print(f"\nreal states: {r['model']}, {r['data']}, layers {r['layers']}, "
          f"{r['codecs']['none']['tokens']:,} tokens, {r['codecs']['none']['raw_hidden_bytes'] / MB:.1f} MB raw bf16")
    print(f"{'codec':<13}{'hidden x raw':>13}  per column{'':<22}{'engine waited s':>16}")
    for codec, c in r["codecs"].items():
        cols = ", ".join(f"{n} {v:.3f}" for n, v in c["per_column_ratio"].items())
        print(f"{codec:<13}{c['ratio_to_raw']:>13.3f}  {cols:<32}{c['engine_waited_s']:>16.3f}")
    sp = r["speed"]
    for codec, v in sp.items():
        print(f"{codec:<13} write {v['write_mb_s_one_lane']:.0f} MB/s on one lane (one core), read {v['read_mb_s']:.0f} MB/s "
              f"({v['read_mb_s'] / sp['none']['read_mb_s']:.2f}x the rows layout)")
    d = r["codecs"]["planes-zstd"]
    print(f"default codec: {d['ratio_to_raw']:.2f}x raw, write {sp['planes-zstd']['write_mb_s_one_lane']:.0f} MB/s/core, "
          f"engine waited {d['engine_waited_s']:.2f} s")


if __name__ == "__main__":
    sys.exit(main())
