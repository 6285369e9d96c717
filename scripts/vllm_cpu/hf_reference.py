"""The transformers engine's samples for the vLLM lane's tests, run in hsx's own virtualenv.

The lane pins transformers 5.19 (vLLM 0.32 wants < 5.20); hsx's transformers engine needs a newer
release, so ``tests/test_vllm_lane.py`` runs this with ``$HSX_VENV/bin/python`` (default ``.venv``):

    python scripts/vllm_cpu/hf_reference.py MODEL PROMPTS.json LAYERS MAX_NEW OUT.safetensors

PROMPTS.json is a list of token-id lists; OUT holds ``ids.<i>`` and ``<column>.<i>`` per prompt.
"""

from __future__ import annotations

import json
import sys

import torch
from safetensors.torch import save_file

from hsx.config import ExtractConfig
from hsx.data.render import Prompt
from hsx.engine.hf.runner import HFRunner


def main(model: str, prompts: str, layers: str, max_new: str, out: str) -> None:
    torch.set_num_threads(2)
    ids = json.loads(open(prompts).read())
    cfg = ExtractConfig(model=model, engine="hf", device="cpu", model_dtype="float32", dtype="float32",
                        layers=layers, max_new_tokens=int(max_new))
    samples = HFRunner(cfg).run([Prompt(f"s{i}", i, x, [1] * len(x)) for i, x in enumerate(ids)])
    tensors = {}
    for i, s in enumerate(samples):
        tensors[f"ids.{i}"] = s.input_ids
        tensors.update({f"{name}.{i}": rows.contiguous() for name, rows in s.hidden.items()})
    save_file(tensors, out)


if __name__ == "__main__":
    main(*sys.argv[1:])
