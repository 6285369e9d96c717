"""Entry point of the real-SGLang CPU lane: every Python process started by ``scripts/sglang_cpu.sh``
(SGLang's scheduler and detokenizer subprocesses included) imports this first, because the lane puts
this folder on ``PYTHONPATH``. See ``cpu_lane/__init__.py`` for what is changed and why."""

import cpu_lane

cpu_lane.install()
