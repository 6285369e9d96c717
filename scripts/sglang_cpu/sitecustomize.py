"""Stand-ins for two packages SGLang imports but that have no CPU build on PyPI.

Only ``torchvision`` and ``sgl_kernel`` are replaced. Every attribute of a stand-in module is
another stand-in; calling one returns a stand-in; subclassing one works. Nothing here computes
anything: a code path that really used one of these packages would produce garbage or fail
later, which is why the CPU check compares every hidden row against an independent transformers
forward instead of trusting that the engine ran.

- ``torchvision``: imported by SGLang's multimodal processors and some model files; the text
  models the check runs never call it.
- ``sgl_kernel``: SGLang's CUDA/CPU kernel package (PyPI ``sglang-kernel``, CUDA only). Imported
  at module level by attention backends, layers and utilities; the CPU path with
  ``attention_backend=torch_native`` and ``SGLANG_USE_CPU_ENGINE=1`` computes with plain torch.
"""

import importlib.abc
import importlib.machinery
import sys
import types

STUBBED = ("torchvision", "sgl_kernel")


class _StubMeta(type):
    def __getattr__(cls, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _new_stub(name)


class _Stub(metaclass=_StubMeta):
    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return _Stub()

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _new_stub(name)

    def __iter__(self):
        return iter(())

    def __bool__(self):
        return False


def _new_stub(name):
    return _StubMeta(name, (_Stub,), {})


class _StubModule(types.ModuleType):
    def __init__(self, name):
        super().__init__(name)
        self.__path__ = []
        self.__version__ = "0.0.0+stub"

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        value = _new_stub(name)
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


sys.meta_path.insert(0, _StubFinder())
