#!/usr/bin/env bash
# The vLLM grid: hsx's vLLM engine plain, under EAGLE, EAGLE3 and n-gram, with chunked prefill on and
# off and a KV cache small enough to preempt, every row compared with an independent teacher-forced
# forward, and a negative control that must be detected. See scripts/vllm_cpu/grid.py for the cells
# and checks, scripts/vllm_cpu.sh for the lane.
#   bash scripts/vllm_cpu_check.sh [--quick] [--skip-control] [--work DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
exec bash scripts/vllm_cpu.sh python scripts/vllm_cpu/grid.py "$@"
