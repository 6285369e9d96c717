"""The shard format: writer, manifest, reader, verification (docs/FORMAT.md)."""

from importlib import import_module

# Names load on first use: importing a torch-free submodule (the CLI's checks before any model
# loads) does not import the rest of the package.
_EXPORTS = {
    "BackgroundSink": "hsx.shards.background",
    "FORMAT_VERSION": "hsx.shards.format",
    "build_metadata": "hsx.shards.format",
    "ErrorRecord": "hsx.shards.manifest",
    "Manifest": "hsx.shards.manifest",
    "ShardEntry": "hsx.shards.manifest",
    "load_manifest": "hsx.shards.manifest",
    "Sample": "hsx.shards.reader",
    "ShardDataset": "hsx.shards.reader",
    "TokenMatrix": "hsx.shards.reader",
    "open_shards": "hsx.shards.reader",
    "Record": "hsx.shards.writer",
    "ShardSink": "hsx.shards.sink",
    "ShardWriter": "hsx.shards.writer",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)
