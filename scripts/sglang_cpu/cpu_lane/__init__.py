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
