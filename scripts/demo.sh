#!/usr/bin/env bash
# The main job on the demo: build a tiny target + draft + tokenizer locally, extract hidden states
# from the shipped prompts with speculative decoding, then inspect the shards and verify them,
# every row against an independent forward of the target (--recompute).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV="${HSX_VENV:-.venv}"
OUT="${1:-demo_out}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
[ -f "$OUT/models/target/config.json" ] || "$VENV/bin/python" -m hsx.demo.build "$OUT/models"
"$VENV/bin/hsx" extract \
  --model "$OUT/models/target" --draft-model "$OUT/models/draft" \
  --dataset hsx/demo_data/prompts.jsonl --id-field id \
  --output "$OUT/shards" --layers final,eagle3,0,8 \
  --mode generate --max-new-tokens 48 --batch-size 8 \
  --spec-num-steps 3 --spec-topk 1 --spec-num-draft-tokens 4
"$VENV/bin/hsx" inspect "$OUT/shards"
"$VENV/bin/hsx" verify "$OUT/shards" --recompute --quiet
