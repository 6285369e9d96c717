"""The device and compute dtype a run asks for (``--device``, ``--model-dtype``), shared by every engine and by recompute."""

from __future__ import annotations

import torch

from hsx.errors import HsxError
from hsx.shards.format import DTYPES


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise HsxError(f"--device {device}: CUDA is not available on this machine")
    return torch.device(device)


def compute_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise HsxError(f"--model-dtype must be auto, bfloat16, float16 or float32, got {name!r}")
    return DTYPES[name]
