"""Stand-ins for the two packages SGLang imports that have no CPU build on PyPI: ``torchvision``, ``sgl_kernel``.

A stand-in module hands out a stand-in object for any attribute, so SGLang's module-level
``from sgl_kernel import ...`` lines (about 120 of them) import. Objects can be subclassed, used
as decorators' targets and so on, but **calling** a ``sgl_kernel`` function raises, naming it:
a kernel that silently did nothing would give a normal-looking run with wrong tokens and rows.
The functions the CPU lane needs are real pure-torch code (:mod:`cpu_lane.kernels`), installed
with :func:`provide`. ``torchvision`` stand-ins stay inert: only multimodal processors use it, and
a text model never calls them.

``HSX_LANE_STANDIN=name[,name]`` leaves the named kernels as silent no-ops even though a real
version exists: the lane's negative control, which must then report misaligned rows.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types

STUBBED = ("torchvision", "sgl_kernel")


class LaneStandInCalled(NotImplementedError):
    pass


class _StubMeta(type):
    def __getattr__(cls, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _new_stub(name, cls._loud)


class _Stub(metaclass=_StubMeta):
    _loud = False
    _qualname = "stub"

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return _Stub()

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _new_stub(name, self._loud)

    def __iter__(self):
        return iter(())

    def __bool__(self):
        return False


def _loud_new(cls, *args, **kwargs):
    # Called as a function (not subclassed): SGLang reached a kernel the lane does not provide.
    if cls._loud and cls.__mro__[1] is _Stub:
        raise LaneStandInCalled(
            f"sgl_kernel.{cls._qualname} was called on the CPU lane, which has no real version of it: "
            "implement it in scripts/sglang_cpu/cpu_lane/kernels.py or keep the run off this path")
    return object.__new__(cls)


def _new_stub(name: str, loud: bool):
    return _StubMeta(name, (_Stub,), {"_loud": loud, "_qualname": name, "__new__": _loud_new})


class _StubModule(types.ModuleType):
    def __init__(self, name: str):
        super().__init__(name)
        self.__path__ = []
        self.__version__ = "0.0.0+stub"
        self._loud = name.split(".")[0] == "sgl_kernel"

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        value = _new_stub(name, self._loud)
        setattr(self, name, value)
        return value


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in STUBBED:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return _StubModule(spec.name)

    def exec_module(self, module):
        pass


def install() -> None:
    """Put the stand-in finder first on ``sys.meta_path`` (idempotent)."""
    if not any(isinstance(f, _StubFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _StubFinder())


def standins_requested() -> set[str]:
    return {n.strip() for n in os.environ.get("HSX_LANE_STANDIN", "").split(",") if n.strip()}


def provide(functions) -> None:
    """Give ``sgl_kernel`` real versions of ``functions`` (by ``__name__``), except those kept as stand-ins."""
    import sgl_kernel

    silent = standins_requested()
    unknown = silent - {f.__name__ for f in functions}
    if unknown:
        raise ValueError(f"HSX_LANE_STANDIN names {sorted(unknown)}, which the lane does not implement")
    for fn in functions:
        setattr(sgl_kernel, fn.__name__, _silent(fn.__name__) if fn.__name__ in silent else fn)


def _silent(name: str):
    def standin(*args, **kwargs):
        return None

    standin.__name__ = name
    return standin
