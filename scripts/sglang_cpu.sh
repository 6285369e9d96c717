#!/usr/bin/env bash
# Run CMD [ARGS...] inside the real-SGLang CPU lane:
#   bash scripts/sglang_cpu.sh hsx extract --engine sglang --spec-algorithm EAGLE3 ...
#   bash scripts/sglang_cpu.sh python -m pytest -m sglang
#
# SGLang has no CPU build on PyPI. This builds (once, or again when this script or pyproject.toml
# changes) a virtualenv of its own ($HSX_SGLANG_VENV, default .venv-sglang, ~3 GB):
#   - torch==2.13.0 (CPU wheel), then sglang==0.5.23 with --no-deps (its wheel pins CUDA torch,
#     flashinfer, sglang-kernel and ~200 packages);
#   - SGLang's pure-Python dependencies under a torch==2.13.0 constraint, triton~=3.8.0 (imported
#     unconditionally; on CPU it only runs kernels through its interpreter), apache-tvm-ffi,
#     compressed-tensors and xgrammar at SGLang's pins;
#   - hsx itself (editable) under the same constraint.
# Then it puts scripts/sglang_cpu/ (and the checkout) on PYTHONPATH, so that every Python process (SGLang's scheduler
# subprocess too) imports scripts/sglang_cpu/sitecustomize.py first: stand-ins for torchvision and
# sgl_kernel, real versions of the sgl_kernel CPU ops on the EAGLE path, and the torch_native
# attention forwards EAGLE needs (scripts/sglang_cpu/cpu_lane/). It sets SGLANG_USE_CPU_ENGINE=1
# and runs CMD with the lane's bin/ first on PATH.
#
# Engine arguments that start SGLang on CPU: --device cpu --attention-backend torch_native
# --engine-arg sampling_backend=pytorch --engine-arg disable_cuda_graph=true (plus a small
# mem_fraction_static / max_total_tokens); scripts/sglang_cpu/grid.py uses exactly these.
#
#   HSX_SGLANG_VENV  the virtualenv to create or reuse (default .venv-sglang)
#   HSX_LANE_STANDIN comma-separated lane kernels to leave as silent no-ops (negative controls)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${HSX_SGLANG_VENV:-$ROOT/.venv-sglang}"
PY="$VENV/bin/python"

install() {
  [ -x "$PY" ] || python3 -m venv "$VENV"
  local stamp="$VENV/.hsx-sglang-installed" want
  want="$(cat "$ROOT/scripts/sglang_cpu.sh" "$ROOT/pyproject.toml" | sha256sum | cut -c1-16)"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    return 0
  fi
  local pip=("$PY" -m pip install -q) cons="$VENV/hsx-constraints.txt" started=$SECONDS
  printf '%s\n' torch==2.13.0 transformers==5.19.0 tokenizers==0.23.2 'python-dateutil<3' > "$cons"
  echo "[sglang-cpu] installing into $VENV (torch 2.13 CPU, sglang 0.5.23 without deps, ~3 GB)" >&2
  "${pip[@]}" torch==2.13.0
  "${pip[@]}" --no-deps sglang==0.5.23
  "${pip[@]}" -c "$cons" \
    numpy pydantic pyzmq fastapi uvicorn uvloop orjson msgspec xxhash transformers==5.19.0 \
    tokenizers==0.23.2 sentencepiece==0.2.1 tiktoken openai==2.8.0 openai-harmony==0.0.4 aiohttp \
    requests psutil setproctitle pybase64 partial_json_parser python-multipart prometheus-client \
    interegular einops packaging pillow scipy tqdm regex zstandard distro llguidance blobfile \
    gguf ninja watchfiles python-dateutil easydict anthropic IPython pytest
  "${pip[@]}" -c "$cons" "triton~=3.8.0" apache-tvm-ffi==0.1.11 compressed-tensors==0.18.0 xgrammar==0.2.7
  (cd "$ROOT" && "${pip[@]}" -c "$cons" -e .)
  # an older lane copied its stand-ins into site-packages; the lane now loads them from PYTHONPATH
  rm -f "$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/sitecustomize.py"
  echo "$want" > "$stamp"
  echo "[sglang-cpu] lane virtualenv ready in $((SECONDS - started)) s" >&2
}

install
# the checkout first: `import hsx` is this checkout's code even where the venv's editable install
# points at another checkout sharing $HSX_SGLANG_VENV
export PYTHONPATH="$ROOT/scripts/sglang_cpu:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export SGLANG_USE_CPU_ENGINE=1
export PATH="$VENV/bin:$PATH"
export VIRTUAL_ENV="$VENV"
[ "$#" -gt 0 ] || { echo "usage: scripts/sglang_cpu.sh CMD [ARGS...]" >&2; exit 2; }
exec "$@"
