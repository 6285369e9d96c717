#!/usr/bin/env bash
# Prefill extraction at Llama-3.1-8B's shape on a GPU: hsx extract vs a bare transformers forward.
# NOT YET MEASURED ON A GPU (only `--tiny` has been run, on a CPU). Needs no download.
#
#   bash scripts/bench_gpu.sh                                 # 2,000 prompts of 500-600 tokens, cuda
#   bash scripts/bench_gpu.sh --prompts 500 --out /scratch/b  # smaller, elsewhere
#   bash scripts/bench_gpu.sh --tiny                          # CPU smoke test
#
# Estimated under 7 minutes on one H200 (model build and save included); needs about 52 GB of free
# disk under --out (default bench_out/gpu). Every option: scripts/bench_gpu.py --help.
#
# hsx's vLLM capture on and off on one card (NOT YET RUN ON A GPU), in a Python that has vLLM 0.32:
#   bash scripts/bench_gpu.sh --vllm MODEL_DIR [--draft EAGLE3_HEAD] [--batches 1,16,64]
# runs scripts/bench_vllm.py --per-step --write on cuda in bf16: the same prompts through plain vLLM and
# through hsx's capture at each batch size; prints ms per engine step, hsx's own time in and after the
# steps, both sides' tokens/s, the MB/s of rows the capture produced and the MB/s (raw and on disk) the
# shard writer wrote them at; JSON in bench_out/bench_vllm.json (--json PATH). Any other option of
# bench_vllm.py --per-step goes after MODEL_DIR and wins (e.g. --device cpu --model-dtype float32 --batches 1
# --new-tokens 4 inside scripts/vllm_cpu.sh, with PYTHON=python, checks the path on a CPU).
# Python: $PYTHON, else .venv/bin/python in the repository, else python3.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PY="$ROOT/.venv/bin/python"; else PY=python3; fi
fi
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
if [[ "${1:-}" == "--vllm" ]]; then
  [[ -n "${2:-}" ]] || { echo "usage: bash scripts/bench_gpu.sh --vllm MODEL_DIR [bench_vllm.py --per-step options]" >&2; exit 2; }
  model="$2"; shift 2
  "$PY" -c "import vllm" || { echo "bench_gpu.sh --vllm: $PY has no vLLM (install vllm==0.32.*)" >&2; exit 2; }
  # the V1 runner hsx's capture reads; the engine core in this process (the bench reaches its runner)
  export VLLM_USE_V2_MODEL_RUNNER=0 VLLM_ENABLE_V1_MULTIPROCESSING=0
  exec "$PY" "$ROOT/scripts/bench_vllm.py" --per-step --write --model "$model" --device cuda --model-dtype bfloat16 \
    --batches 1,16,64 --new-tokens 128 "$@"
fi
# hsx's own requirements (scripts/setup.sh installs them): the transformers engine needs >= 5.24
"$PY" - <<'CHECK' || { echo "bench_gpu.sh: install hsx's requirements first (bash scripts/setup.sh)" >&2; exit 2; }
import datasets, pyarrow, typer, transformers
from packaging.version import Version
from hsx.engine.hf.engine import MIN_TRANSFORMERS
assert Version(transformers.__version__) >= Version(MIN_TRANSFORMERS), f"transformers {transformers.__version__} < {MIN_TRANSFORMERS}"
CHECK
exec "$PY" "$ROOT/scripts/bench_gpu.py" "$@"
