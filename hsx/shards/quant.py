"""Lossy hidden-state codecs: int8 and float8 e4m3 codes with one bfloat16 scale per group of 64 values.

A row of W values is cut into ``ceil(W / 64)`` groups of 64 consecutive values; the last group
holds ``W % 64`` values when 64 does not divide W (no padding is stored). Each group's scale is
its absolute maximum over the code's largest value (127 for int8, 448 for e4m3), rounded up to
bfloat16, so that the group's largest value maps inside the code's range; a group of zeros has
scale 0 and codes 0. Codes are ``round(x / scale)`` (int8, |error| <= scale / 2) or the nearest
e4m3 value of ``x / scale`` (relative error <= 2^-4, absolute <= 2^-10 * scale below e4m3's
smallest normal 2^-6). docs/FORMAT.md gives the bytes; docs/STORAGE.md the measured error.
"""

from __future__ import annotations

import torch

GROUP = 64
SCALE_DTYPE = torch.bfloat16
# code dtype and its largest finite value
CODES: dict[str, tuple[torch.dtype, float]] = {
    "int8": (torch.int8, 127.0),
    "float8_e4m3": (torch.float8_e4m3fn, 448.0),
}
# bfloat16 rounds to nearest with relative error <= 2^-8: scaling up by 2^-7 first keeps the
# stored scale >= absmax / qmax
_ROUND_UP = 1.0 + 2.0**-7


def groups(width: int) -> int:
    """Scales per row of ``width`` values."""
    return -(-width // GROUP)


def quantize(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``[R, W]`` floats -> (codes ``[R, W]`` in the code dtype, scales ``[R, ceil(W/64)]`` bfloat16).

    Non-finite values have no code: they raise ``ValueError``.
    """
    code_dtype, qmax = CODES[kind]
    rows, width = x.shape
    g = groups(width)
    if rows == 0:
        return torch.empty((0, width), dtype=code_dtype), torch.empty((0, g), dtype=SCALE_DTYPE)
    padded = torch.nn.functional.pad(x.float(), (0, g * GROUP - width)).view(rows, g, GROUP)
    absmax = padded.abs().amax(dim=-1)
    if not bool(torch.isfinite(absmax).all()):
        raise ValueError("hidden rows hold inf or NaN values, which no lossy code represents")
    scale = (absmax * (_ROUND_UP / qmax)).to(SCALE_DTYPE)
    divisor = torch.where(scale > 0, scale.float(), 1.0).unsqueeze(-1)
    q = (padded / divisor).clamp_(-qmax, qmax)
    if code_dtype == torch.int8:
        q = q.round_()
    codes = q.to(code_dtype).view(rows, g * GROUP)[:, :width]
    return codes.contiguous(), scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The inverse of :func:`quantize`: codes ``[R, W]`` and scales ``[R, G]`` -> ``[R, W]`` in ``dtype``."""
    width = codes.shape[1]
    per_value = scale.float().repeat_interleave(GROUP, dim=1)[:, :width]
    return (codes.float() * per_value).to(dtype)
