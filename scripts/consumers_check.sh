#!/usr/bin/env bash
# hsx's exports read by the trainers' own code, each in a virtualenv of its own:
#   speculators 0.9.0 (vLLM's EAGLE3 trainer): its ArrowDataset + shift_batch on `hsx export speculators`;
#   SAELens 6.54.12: its ActivationsStore on `hsx export saelens`, then SAE training steps.
# Shards come from hsx's own venv (a tiny demo target built locally, prefill and generate runs);
# each consumer venv then reads the export with the consumer's code and the shards with hsx.open
# (this checkout on PYTHONPATH) and compares them value for value.
#   bash scripts/consumers_check.sh [speculators] [saelens]      (default: both)
# $HSX_CONSUMERS_WORK keeps the shards and exports (default: a temp directory, removed at exit).
# Virtualenvs: $HSX_VENV (hsx, via scripts/setup.sh), $HSX_SPECULATORS_VENV (default
# .venv-speculators), $HSX_SAELENS_VENV (default .venv-saelens); each is rebuilt only when this
# script or pyproject.toml changes (a stamp file). torch==2.13.0 (the CPU wheel) goes in first so
# that nothing pulls a CUDA build; the consumers' other pins are theirs.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
HSX_PY="${HSX_VENV:-$ROOT/.venv}/bin/python"
if [ -n "${HSX_CONSUMERS_WORK:-}" ]; then
  WORK="$HSX_CONSUMERS_WORK"
  mkdir -p "$WORK"
else
  WORK="$(mktemp -d)"
  trap 'rm -rf "$WORK"' EXIT
fi
which=("$@")
[ "${#which[@]}" -gt 0 ] || which=(speculators saelens)

stamp_ok() {  # VENV NAME: whether VENV was built by this version of the recipe
  local want
  want="$(cat "$ROOT/scripts/consumers_check.sh" "$ROOT/pyproject.toml" | sha256sum | cut -c1-16)"
  [ -f "$1/.hsx-$2-installed" ] && [ "$(cat "$1/.hsx-$2-installed")" = "$want" ] && return 0
  echo "$want" > "$1/.hsx-$2-wanted"
  return 1
}

build_venv() {  # NAME VENV: create VENV with torch (CPU) and the consumer NAME
  local name="$1" venv="$2" started=$SECONDS
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  stamp_ok "$venv" "$name" && return 0
  local pip=("$venv/bin/python" -m pip install -q) cons="$venv/hsx-constraints.txt"
  echo "[consumers] building $venv for $name" >&2
  "${pip[@]}" torch==2.13.0
  case "$name" in
    speculators)
      # the wheel also wants torchaudio/torchvision and mooncake extras it never imports on this path
      printf '%s\n' torch==2.13.0 transformers==5.19.0 datasets==5.1.0 > "$cons"
      "${pip[@]}" --no-deps speculators==0.9.0 hs-connectors==0.9.0
      "${pip[@]}" -c "$cons" transformers==5.19.0 datasets==5.1.0 safetensors 'loguru>=0.7.2,<=0.7.3' \
        pydantic pydantic-settings openai httpx aiohttp rich typer click psutil protobuf huggingface-hub \
        'tqdm<=4.70.1' 'numpy<=2.5.4' pyarrow xxhash ;;
    saelens)
      printf '%s\n' torch==2.13.0 > "$cons"
      "${pip[@]}" -c "$cons" sae-lens==6.54.12 pyarrow xxhash ;;
  esac
  mv "$venv/.hsx-$name-wanted" "$venv/.hsx-$name-installed"
  echo "[consumers] $name venv built in $((SECONDS - started)) s" >&2
}

make_shards() {  # demo target (+ draft) -> prefill and speculative generate shards, then the exports
  [ -f "$WORK/models/target/config.json" ] || "$HSX_PY" -m hsx.demo.build "$WORK/models" >&2
  local common=(--model "$WORK/models/target" --dataset hsx/demo_data/prompts.jsonl --id-field id
                --layers final,eagle3,8 --batch-size 8 --quiet)
  "$HSX_PY" -m hsx.cli extract "${common[@]}" --mode prefill --output "$WORK/prefill" >&2
  "$HSX_PY" -m hsx.cli extract "${common[@]}" --mode generate --max-new-tokens 24 --draft-model "$WORK/models/draft" \
    --spec-num-steps 3 --spec-topk 1 --spec-num-draft-tokens 4 --limit 20 --output "$WORK/generate" >&2
  for run in prefill generate; do
    "$HSX_PY" -m hsx.cli export speculators "$WORK/$run" "$WORK/spec_$run" --quiet
  done
  "$HSX_PY" -m hsx.cli export saelens "$WORK/prefill" "$WORK/sae_b4" --column b4 --context-size 32 --quiet
  # negative controls: a tampered speculators export, boundary 5 under boundary 4's hook name
  tamper "$WORK/spec_prefill" "$WORK/spec_tampered"
  "$HSX_PY" -m hsx.cli export saelens "$WORK/prefill" "$WORK/sae_b5_as_b4" --column b5 --context-size 32 \
    --hook-name blocks.4.hook_resid_pre --quiet
}

tamper() {  # a copy of a speculators export with one value of one verifier state changed
  rm -rf "$2" && cp -r "$1" "$2"
  "$HSX_PY" - "$2/hidden_states/hs_3.safetensors" <<'PY'
import sys
from safetensors.torch import load_file, save_file
f = load_file(sys.argv[1])
f["hidden_states"][5, -1, 7] += 1
save_file(f, sys.argv[1])
PY
}

must_fail() {  # PATTERN CMD...: a check given a wrong export must fail, with PATTERN in its output
  local pattern="$1"
  shift
  if "$@" > "$WORK/control.log" 2>&1 || ! grep -q "$pattern" "$WORK/control.log"; then
    echo "[consumers] negative control did not fail with '$pattern': $*" >&2
    tail -5 "$WORK/control.log" >&2
    exit 1
  fi
  echo "[consumers] negative control failed as it must: $(grep "$pattern" "$WORK/control.log" | tail -1)"
}

export HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
bash scripts/setup.sh
started=$SECONDS
make_shards
echo "[consumers] shards and exports in $WORK ($((SECONDS - started)) s)"
for name in "${which[@]}"; do
  case "$name" in
    speculators) venv="${HSX_SPECULATORS_VENV:-$ROOT/.venv-speculators}" ;;
    saelens) venv="${HSX_SAELENS_VENV:-$ROOT/.venv-saelens}" ;;
    *) echo "unknown consumer $name (speculators, saelens)" >&2; exit 2 ;;
  esac
  t=$SECONDS
  build_venv "$name" "$venv"
  echo "[consumers] $name venv ready ($((SECONDS - t)) s)"
  t=$SECONDS
  case "$name" in
    speculators)
      "$venv/bin/python" scripts/consumers/speculators_check.py --aux 2,4,5 --layers 8 \
        "$WORK/prefill=$WORK/spec_prefill" "$WORK/generate=$WORK/spec_generate"
      must_fail "verifier state differs" "$venv/bin/python" scripts/consumers/speculators_check.py --aux 2,4,5 --layers 8 \
        "$WORK/prefill=$WORK/spec_tampered" ;;
    saelens)
      "$venv/bin/python" scripts/consumers/saelens_check.py --shards "$WORK/prefill" --export "$WORK/sae_b4" \
        --boundary 4 --context-size 32
      must_fail "activations differ" "$venv/bin/python" scripts/consumers/saelens_check.py --shards "$WORK/prefill" \
        --export "$WORK/sae_b5_as_b4" --boundary 4 --context-size 32 --steps 0 ;;
  esac
  echo "[consumers] $name check passed ($((SECONDS - t)) s)"
done
