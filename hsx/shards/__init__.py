"""The shard format: writer, manifest, reader, verification (docs/FORMAT.md)."""

from hsx.shards.background import BackgroundSink
from hsx.shards.format import FORMAT_VERSION, build_metadata
from hsx.shards.manifest import ErrorRecord, Manifest, ShardEntry, load_manifest
from hsx.shards.reader import Sample, ShardDataset, TokenMatrix, open_shards
from hsx.shards.writer import Record, ShardSink, ShardWriter

__all__ = [
    "FORMAT_VERSION", "build_metadata", "ErrorRecord", "Manifest", "ShardEntry", "load_manifest",
    "Sample", "ShardDataset", "TokenMatrix", "open_shards", "Record", "ShardSink", "ShardWriter", "BackgroundSink",
]
