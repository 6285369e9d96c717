"""Dataset ingestion: read rows (load) and turn them into token ids and loss masks (render)."""

from importlib import import_module

# Names load on first use: importing a torch-free submodule (the CLI's checks before any model
# loads) does not import the rest of the package.
_EXPORTS = {
    "dataset_fingerprint": "hsx.data.load",
    "describe": "hsx.data.load",
    "load_rows": "hsx.data.load",
    "Prompt": "hsx.data.render",
    "Renderer": "hsx.data.render",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)
