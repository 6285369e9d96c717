#!/usr/bin/env bash
# Opt-in check of `hsx extract --engine sglang` against a real SGLang 0.5.23, on CPU.
#
# SGLang has no CPU build on PyPI, so this builds its own virtualenv ($HSX_SGLANG_VENV, default
# .venv-sglang, ~3 GB) the way it is known to start on a CPU machine:
#   - torch==2.13.0 (CPU wheel), then `sglang==0.5.23` with --no-deps (its wheel pins CUDA torch,
#     flashinfer, sglang-kernel and ~200 packages);
#   - its pure-Python dependencies under a torch==2.13.0 constraint, plus triton~=3.8.0 (imported
#     unconditionally), apache-tvm-ffi, compressed-tensors and xgrammar at SGLang's pins;
#   - hsx itself (editable) under the same constraint;
#   - scripts/sglang_cpu/sitecustomize.py copied into the venv: it replaces exactly two packages
#     with stand-in modules whose every attribute is a no-op object:
#       torchvision  (multimodal processors; a text model never calls it),
#       sgl_kernel   (SGLang's CUDA kernel package; the CPU engine with the torch_native
#                     attention backend computes with plain torch).
#     A stand-in answers any call silently, so this check trusts nothing but numbers: the
#     SGLang shards are compared row by row with the transformers engine's.
# Then it builds two tiny untrained Llama models (fp32), runs `hsx extract --engine sglang`
# (device=cpu, attention_backend=torch_native, SGLANG_USE_CPU_ENGINE=1, float32, greedy, no
# speculation) and `hsx extract --engine hf` on the same prompts, and compares the shards:
# tokens must be equal and every hidden row within 1e-4. Exit status 0 only when they match.
#
# The reference shards come from `hsx extract --engine hf` in the project's own virtualenv
# ($HSX_VENV, default .venv, made by scripts/setup.sh): SGLang pins transformers 5.19, and hsx's
# transformers engine is tested with the release in .venv.
#
# Usage: scripts/sglang_cpu_check.sh [--install-only]
#   HSX_SGLANG_VENV  the virtualenv to create or reuse (default .venv-sglang)
#   HSX_VENV         the project's virtualenv for the reference run (default .venv)
#   HSX_SGLANG_WORK  scratch directory for models and shards (default: a new temp dir)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${HSX_SGLANG_VENV:-.venv-sglang}"
PY="$VENV/bin/python"
PIP=("$PY" -m pip install -q)

install() {
  [ -x "$PY" ] || python3 -m venv "$VENV"
  local stamp="$VENV/.hsx-sglang-installed"
  local want
  want="$( (cat "$0" scripts/sglang_cpu/sitecustomize.py pyproject.toml) | sha256sum | cut -c1-16)"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    return 0
  fi
  local cons="$VENV/hsx-constraints.txt"
  printf '%s\n' torch==2.13.0 transformers==5.19.0 tokenizers==0.23.2 'python-dateutil<3' > "$cons"
  echo "[sglang-check] installing into $VENV (torch 2.13 CPU, sglang 0.5.23 without deps, ~3 GB)"
  "${PIP[@]}" torch==2.13.0
  "${PIP[@]}" --no-deps sglang==0.5.23
  "${PIP[@]}" -c "$cons" \
    numpy pydantic pyzmq fastapi uvicorn uvloop orjson msgspec xxhash transformers==5.19.0 \
    tokenizers==0.23.2 sentencepiece==0.2.1 tiktoken openai==2.8.0 openai-harmony==0.0.4 aiohttp \
    requests psutil setproctitle pybase64 partial_json_parser python-multipart prometheus-client \
    interegular einops packaging pillow scipy tqdm regex zstandard distro llguidance blobfile \
    gguf ninja watchfiles python-dateutil easydict anthropic IPython
  "${PIP[@]}" -c "$cons" "triton~=3.8.0" apache-tvm-ffi==0.1.11 compressed-tensors==0.18.0 xgrammar==0.2.7
  "${PIP[@]}" -c "$cons" -e .
  local site
  site="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  cp scripts/sglang_cpu/sitecustomize.py "$site/sitecustomize.py"
  SGLANG_USE_CPU_ENGINE=1 "$PY" -c "import sglang, hsx; from sglang import Engine; print('[sglang-check] sglang', sglang.__version__)"
  echo "$want" > "$stamp"
}

install
[ "${1:-}" = "--install-only" ] && exit 0

WORK="${HSX_SGLANG_WORK:-$(mktemp -d -t hsx-sglang-XXXXXX)}"
mkdir -p "$WORK"
export SGLANG_USE_CPU_ENGINE=1
echo "[sglang-check] work dir $WORK"
bash scripts/setup.sh
"$PY" scripts/sglang_cpu/check.py "$WORK" "$(cd "${HSX_VENV:-.venv}" && pwd)/bin/hsx"
