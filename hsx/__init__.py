"""hsx: per-token hidden states from speculative decoding engines, aligned and stored as Parquet shards."""

__version__ = "0.1.0"

from hsx.errors import AlignmentError, HsxError, SampleError, ShardError  # noqa: E402

__all__ = ["__version__", "HsxError", "AlignmentError", "SampleError", "ShardError", "open", "stream", "tokens_loader"]


def open(path, **kwargs):  # noqa: A001 - the public name is hsx.open
    """Open a directory of shards (or one shard file) for reading; see :class:`hsx.shards.reader.ShardDataset`."""
    from hsx.shards.reader import open_shards

    return open_shards(path, **kwargs)


def tokens_loader(path, columns=None, where="all", batch_size=1024, shuffle_buffer=1 << 16, seed=0, **kwargs):
    """A streaming torch ``IterableDataset`` of token rows in shuffled batches; see :mod:`hsx.shards.loader`."""
    from hsx.shards.loader import tokens_loader as make

    return make(path, columns, where, batch_size, shuffle_buffer, seed, **kwargs)


def stream(config, **kwargs):
    """Run ``config`` (an ExtractConfig, a dict or a config file) and yield its aligned samples as they
    come, with no shards; see :class:`hsx.feed.Feed` (``ahead``, ``ordered``, ``progress``)."""
    from hsx.feed import Feed

    return Feed(config, **kwargs)
