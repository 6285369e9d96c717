"""Alignment core: pure tensor code shared by every engine (no engine imports here)."""

from importlib import import_module

# Names load on first use: importing a torch-free submodule (the CLI's checks before any model
# loads) does not import the rest of the package.
_EXPORTS = {
    "EAGLE3": "hsx.align.layers",
    "FINAL": "hsx.align.layers",
    "LayerGroup": "hsx.align.layers",
    "ModelShape": "hsx.align.layers",
    "needed_sources": "hsx.align.layers",
    "parse_layers": "hsx.align.layers",
    "AlignedSample": "hsx.align.rows",
    "Collector": "hsx.align.rows",
    "accepted_mask": "hsx.align.rows",
    "slice_verify_step": "hsx.align.rows",
    "teacher_forced": "hsx.align.rows",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)
