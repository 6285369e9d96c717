"""The package version, recorded in every shard's metadata (``hsx_version``)."""

__version__ = "0.1.0"
