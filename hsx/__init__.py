"""hsx: per-token hidden states from speculative decoding engines, aligned and stored as Parquet shards.

From Python::

    import hsx
    cfg = hsx.ExtractConfig(model=..., dataset=..., output="out")
    summary = hsx.extract(cfg, progress=False)  # progress=False: the CLI's --quiet
    ds = hsx.open("out")

``import hsx`` loads nothing heavy: ``extract``, ``ExtractConfig`` and the subpackages
(``hsx.run.pipeline``, ``hsx.recompute``, ``hsx.analysis``, ...) are imported on first use.
"""

from importlib import import_module

from hsx.errors import AlignmentError, HsxError, SampleError, ShardError
from hsx.version import __version__

__all__ = ["__version__", "HsxError", "AlignmentError", "SampleError", "ShardError", "open", "stream", "tokens_loader", "decode"]

# name -> the module that defines it, imported when the name is first used
_LAZY = {"extract": "hsx.run.pipeline", "RunSummary": "hsx.run.pipeline", "ExtractConfig": "hsx.config"}
SUBMODULES = ("align", "analysis", "compare", "config", "data", "demo", "device", "eagle3", "engine", "export", "heads",
              "recompute", "run", "shards", "storage")
__all__ += list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    if name in SUBMODULES:
        return import_module(f"hsx.{name}")
    raise AttributeError(f"module 'hsx' has no attribute {name!r}")


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
    come, with no shards; see :class:`hsx.run.feed.Feed` (``ahead``, ``ordered``, ``progress``, ``verbose``: the libraries' loading bars;
    ``rank``, ``world_size``, ``remainder``, ``group``, ``rank_timeout``: one rank's share of a pool of Ray engines shared by a trainer's ranks)."""
    from hsx.run.feed import Feed

    return Feed(config, **kwargs)


def decode(cell, width, dtype="bfloat16", codec="planes-zstd"):
    """One hidden-state cell as pandas or pyarrow read it -> ``[rows, W]`` numpy array; see :func:`hsx.shards.cells.decode`."""
    from hsx.shards.cells import decode as run

    return run(cell, width, dtype, codec)
