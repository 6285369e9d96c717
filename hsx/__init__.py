"""hsx: per-token hidden states from speculative decoding engines, aligned and stored as Parquet shards."""

__version__ = "0.1.0"

from hsx.errors import AlignmentError, HsxError, SampleError, ShardError  # noqa: E402

__all__ = ["__version__", "HsxError", "AlignmentError", "SampleError", "ShardError", "open", "tokens_loader", "decode"]


def open(path, **kwargs):  # noqa: A001 - the public name is hsx.open
    """Open a directory of shards (or one shard file) for reading; see :class:`hsx.shards.reader.ShardDataset`."""
    from hsx.shards.reader import open_shards

    return open_shards(path, **kwargs)


def tokens_loader(path, columns=None, where="all", batch_size=1024, shuffle_buffer=1 << 16, seed=0, **kwargs):
    """A streaming torch ``IterableDataset`` of token rows in shuffled batches; see :mod:`hsx.shards.loader`."""
    from hsx.shards.loader import tokens_loader as make

    return make(path, columns, where, batch_size, shuffle_buffer, seed, **kwargs)


def decode(cell, width, dtype="bfloat16", codec="planes-zstd"):
    """One hidden-state cell as pandas or pyarrow read it -> ``[rows, W]`` numpy array; see :func:`hsx.shards.format.decode`."""
    from hsx.shards.format import decode as run

    return run(cell, width, dtype, codec)
