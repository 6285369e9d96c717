"""Engine name -> runner class, imported on first use; and the one function that builds a run's engine.

An engine is one folder under ``hsx/engine/`` plus one line in :data:`ENGINES`. :func:`register`
adds one from outside the package (a plugin, or a test's stub runner). Nothing here imports an
engine until it is asked for, so ``import sglang`` and ``import vllm`` stay in their folders.
"""

from __future__ import annotations

from importlib import import_module

from hsx.config import ExtractConfig
from hsx.errors import HsxError

# name -> "module:Class" of a subclass of hsx.engine.contract.Runner
ENGINES: dict[str, str] = {
    "hf": "hsx.engine.hf.runner:HFRunner",
    "sglang": "hsx.engine.sglang.runner:SGLangRunner",
    "vllm": "hsx.engine.vllm.runner:VLLMRunner",
}


def register(name: str, target: str) -> None:
    """Make ``--engine name`` build ``target`` ("package.module:Class", a :class:`~hsx.engine.contract.Runner`)."""
    if ":" not in target:
        raise HsxError(f"engine {name!r}: expected 'module:Class', got {target!r}")
    ENGINES[name] = target


def unregister(name: str) -> None:
    """Forget an engine :func:`register` added (the built-in ones stay)."""
    ENGINES.pop(name, None)


def runner_class(name: str):
    """The runner class of engine ``name``."""
    if name not in ENGINES:
        raise HsxError(f"unknown engine {name!r}; expected one of {', '.join(ENGINES)}")
    module, _, cls = ENGINES[name].partition(":")
    return getattr(import_module(module), cls)


def check_engine(cfg: ExtractConfig) -> None:
    """``cfg.engine`` names a known engine and that engine takes ``cfg`` (before anything loads)."""
    runner_class(cfg.engine).check_config(cfg)


def build_engine(cfg: ExtractConfig):
    """The runner of ``cfg``; over an hsx output's tokens, its prefill checked against that output
    (:mod:`hsx.engine.replay`)."""
    from hsx.data.stored import is_hsx_output

    if is_hsx_output(cfg.dataset):
        from hsx.engine.replay.runner import StoredTokensRunner

        return StoredTokensRunner(cfg, _runner_of, runner_class(cfg.engine).id_reading)
    return _runner_of(cfg)


def _runner_of(cfg: ExtractConfig):
    return runner_class(cfg.engine)(cfg)
