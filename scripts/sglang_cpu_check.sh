#!/usr/bin/env bash
# The real-SGLang grid: hsx's SGLang engine under EAGLE and EAGLE3 (chain and tree), every row
# compared with an independent teacher-forced forward, and a negative control that must fail.
# See scripts/sglang_cpu/grid.py for the cells and checks, scripts/sglang_cpu.sh for the lane.
#   bash scripts/sglang_cpu_check.sh [--quick] [--skip-control] [--work DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
exec bash scripts/sglang_cpu.sh python scripts/sglang_cpu/grid.py "$@"
