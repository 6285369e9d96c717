"""Compare `hsx extract --engine sglang` (real SGLang, CPU) with `--engine hf` on a tiny model.

Run by scripts/sglang_cpu_check.sh inside its SGLang virtualenv: python check.py WORK_DIR HF_HSX.
HF_HSX is the `hsx` executable of the project's own virtualenv: the reference shards come from the
transformers engine there (SGLang pins an older transformers than hsx's engine is tested with).
Exit status 0 only when every compared pair has equal tokens and rows within TOLERANCE.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import torch

import hsx
from hsx.demo.models import build_tiny_llama
from hsx.demo.tokenizer import build_demo_tokenizer

TOLERANCE = 1e-4
PROMPTS = [
    {"id": "a", "text": "The river ran past the old mill and under the stone bridge."},
    {"id": "b", "text": "Bees"},
    {"id": "c", "messages": [{"role": "user", "content": "How do tides work?"}]},
    {"id": "d", "text": "A longer line of plain text, so that the batch holds prompts of rather different lengths."},
    {"id": "e", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]},
]
# SGLang on CPU: the settings that start it there (hsx adds radix cache off, chunked prefill off,
# hidden states on, token ids in).
CPU_ENGINE_ARGS = {"attention_backend": "torch_native", "sampling_backend": "pytorch", "disable_cuda_graph": True,
                   "mem_fraction_static": 0.05, "max_total_tokens": 4096, "context_length": 1024}


def toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)
    return str(v)


def write_config(path: Path, **fields) -> Path:
    engine_args = fields.pop("engine_args", {})
    lines = [f"{k} = {toml_value(v)}" for k, v in fields.items()]
    if engine_args:
        lines += ["", "[engine_args]"] + [f"{k} = {toml_value(v)}" for k, v in engine_args.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def run_extract(work: Path, name: str, hsx_bin: Path, **fields) -> tuple[Path, float]:
    out = work / name
    cfg = write_config(work / f"{name}.toml", output=str(out), **fields)
    t0 = time.perf_counter()
    proc = subprocess.run([str(hsx_bin), "extract", "--config", str(cfg), "--overwrite", "--quiet"],
                          capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        print(proc.stdout[-3000:], proc.stderr[-6000:], sep="\n")
        raise SystemExit(f"[sglang-check] FAIL: hsx extract ({name}) exited {proc.returncode}")
    print(f"[sglang-check] {name}: {seconds:.1f} s; " + proc.stdout.strip().replace("\n", " | "))
    return out, seconds


def compare(ref_dir: Path, got_dir: Path, label: str) -> bool:
    ref, got = hsx.open(ref_dir), hsx.open(got_dir)
    ok = ref.sample_ids == got.sample_ids
    if not ok:
        print(f"[sglang-check] {label}: sample ids differ: {ref.sample_ids} vs {got.sample_ids}")
    names = [g["name"] for g in ref.metadata["layers"]]
    worst, rows, scale = 0.0, 0, 0.0
    for a, b in zip(ref, got):
        if not torch.equal(a.input_ids, b.input_ids):
            print(f"[sglang-check] {label}: sample {a.sample_id}: tokens differ\n  hf     {a.input_ids.tolist()}\n"
                  f"  sglang {b.input_ids.tolist()}")
            ok = False
            continue
        for n in names:
            x, y = a.hidden(n).float(), b.hidden(n).float()
            if x.shape != y.shape:
                print(f"[sglang-check] {label}: sample {a.sample_id} {n}: shapes {tuple(x.shape)} vs {tuple(y.shape)}")
                ok = False
                continue
            diff = (x - y).abs().max().item() if x.numel() else 0.0
            worst, rows, scale = max(worst, diff), rows + x.shape[0], max(scale, x.abs().max().item() if x.numel() else 0.0)
    ok = ok and worst <= TOLERANCE and rows > 0
    print(f"[sglang-check] {label}: {len(ref.sample_ids)} samples, {rows} rows, max |sglang - hf| = {worst:.3e} "
          f"(largest |value| {scale:.3f}, tolerance {TOLERANCE:g}) -> {'OK' if ok else 'MISMATCH'}")
    return ok


def main(work: Path, hf_hsx: Path) -> int:
    work.mkdir(parents=True, exist_ok=True)
    tok = build_demo_tokenizer()
    model = build_tiny_llama(num_layers=8, hidden_size=128, vocab_size=len(tok), seed=7,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model_dir = work / "model"
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    data = work / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in PROMPTS))
    common = dict(model=str(model_dir), dataset=str(data), id_field="id", device="cpu", model_dtype="float32",
                  dtype="float32", max_new_tokens=8, batch_size=5)
    results = {}
    for layers in ("final", "eagle3"):
        hf_dir, _ = run_extract(work, f"hf-{layers}", hf_hsx, engine="hf", layers=layers, **common)
        sgl_dir, _ = run_extract(work, f"sglang-{layers}", Path(sys.executable).with_name("hsx"), engine="sglang",
                                 layers=layers, engine_args=CPU_ENGINE_ARGS, **common)
        results[layers] = compare(hf_dir, sgl_dir, f"layers={layers}")
    print("[sglang-check] " + ", ".join(f"{k}: {'OK' if v else 'MISMATCH'}" for k, v in results.items()))
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main(Path(sys.argv[1]), Path(sys.argv[2])))
