"""The real-SGLang CPU lane's changes to SGLang 0.5.23, applied from ``sitecustomize`` in every process.

Test-only code: the ``hsx`` package never imports it. What it does, and nothing more:

1. :mod:`cpu_lane.stubs`: stand-in modules for ``torchvision`` and ``sgl_kernel``; calling a
   ``sgl_kernel`` function the lane does not provide raises.
2. :mod:`cpu_lane.kernels`: real versions of the eight ``sgl_kernel`` CPU ops on the EAGLE path.
3. ``SGLANG_NATIVE_MOVE_KV_CACHE=1``: SGLang moves tree KV rows by indexing (its own option), so no
   raw-pointer copy is needed.
4. After ``sglang.srt.layers.attention.attention_registry`` is imported: ``torch_native`` is
   registered again (``register_attention_backend``) as :class:`cpu_lane.attention.SpecTorchNativeBackend`,
   the stock backend plus the tree-masked TARGET_VERIFY forward.
5. After ``sglang.srt.speculative.draft_utils`` is imported: ``DraftBackendFactory._create_backend``
   is wrapped so that its backend maps have a ``torch_native`` entry (the multi-step draft decode
   container, and the draft-extend backend) instead of raising "EAGLE is not supported in
   decode attention backend torch_native".

6. With ``HSX_LANE_FORBID_LISTS=1``: SGLang's two float-list builders
   (``_append_prefill_hidden_states``, ``_append_decode_hidden_states`` of the result processor)
   raise ``LaneListPathTaken``, so a run that selects hsx's capture fails if SGLang's list path
   is taken anyway.

7. With ``HSX_LANE_CAPTURE_CLOCK=PATH`` (benchmarks): after ``hsx.engine.sglang.capture`` is imported, the
   result-processor wrappers it installs are timed; each call appends to PATH its own seconds (the
   wrapper's time less the SGLang method it wraps).

All of it names 0.5.23's private modules; another SGLang version is refused.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys

SGLANG_VERSION = "0.5.23"


def install() -> None:
    from cpu_lane import stubs

    stubs.install()
    from cpu_lane import kernels

    stubs.provide(kernels.OPS)
    os.environ.setdefault("SGLANG_NATIVE_MOVE_KV_CACHE", "1")
    if not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport({
            "sglang.srt.layers.attention.attention_registry": _register_torch_native,
            "sglang.srt.speculative.draft_utils": _teach_draft_factory,
            "sglang.srt.managers.scheduler_components.batch_result_processor": _forbid_lists,
            "hsx.engine.sglang.capture": _clock_capture,
        }))


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``hooks[name](module)`` right after module ``name`` has executed (no source is edited)."""

    def __init__(self, hooks):
        self.hooks = hooks

    def find_spec(self, name, path=None, target=None):
        hook = self.hooks.get(name)
        if hook is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            hook(module)

        spec.loader.exec_module = exec_module
        return spec


def _check_version() -> None:
    import sglang

    found = getattr(sglang, "__version__", None)
    if found != SGLANG_VERSION:
        raise RuntimeError(f"the CPU lane patches SGLang {SGLANG_VERSION}'s private modules; found SGLang {found}")


def _create_torch_native(runner):
    from cpu_lane.attention import SpecTorchNativeBackend

    return SpecTorchNativeBackend(runner)


def _register_torch_native(registry) -> None:
    _check_version()
    registry.register_attention_backend("torch_native")(_create_torch_native)


def _teach_draft_factory(draft_utils) -> None:
    factory = draft_utils.DraftBackendFactory
    create = factory._create_backend

    def _create_backend(self, backend_name, backend_map, error_template, stamps_children=False):
        if "torch_native" not in backend_map:
            from cpu_lane import attention

            if stamps_children:  # the multi-step draft decode container
                build = lambda: ("torch_native", attention.TorchNativeMultiStepDraftBackend(
                    self.draft_model_runner, self.topk, self.speculative_num_steps))
            else:  # draft extend
                build = lambda: ("torch_native", attention.SpecTorchNativeBackend(self.draft_model_runner))
            backend_map = {**backend_map, "torch_native": build}
        return create(self, backend_name, backend_map, error_template, stamps_children)

    factory._create_backend = _create_backend


class LaneListPathTaken(RuntimeError):
    """SGLang built hidden-state float lists in a run that forbade them (HSX_LANE_FORBID_LISTS=1)."""


def _forbid_lists(brp) -> None:
    if os.environ.get("HSX_LANE_FORBID_LISTS") != "1":
        return
    proc = brp.SchedulerBatchResultProcessor

    def tripwire(name):
        def taken(*args, **kwargs):
            raise LaneListPathTaken(f"SGLang's {name} ran (.cpu().tolist() of hidden states) although "
                                    "HSX_LANE_FORBID_LISTS=1: hsx's capture let the list path through")
        return staticmethod(taken) if isinstance(proc.__dict__[name], staticmethod) else taken

    for name in ("_append_prefill_hidden_states", "_append_decode_hidden_states"):
        setattr(proc, name, tripwire(name))


def _clock_capture(capture) -> None:
    path = os.environ.get("HSX_LANE_CAPTURE_CLOCK")
    if not path:
        return
    import time

    def timed(make):
        def make_timed(fn, *args):
            inside = [0.0]

            def sglang_method(*a, **k):
                t = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    inside[0] += time.perf_counter() - t

            wrapped = make(sglang_method, *args)

            def clocked(*a, **k):
                t, before = time.perf_counter(), inside[0]
                try:
                    return wrapped(*a, **k)
                finally:
                    own = time.perf_counter() - t - (inside[0] - before)
                    with open(path, "a") as f:
                        f.write(f"{own:.9f}\n")

            return clocked

        return make_timed

    capture._wrap_prefill = timed(capture._wrap_prefill)
    capture._wrap_decode = timed(capture._wrap_decode)
