"""Read-only tensors over a shard's memory.

torch has no read-only tensors: a view of an Arrow buffer is writable, and writing into it would
change what every later read of that shard returns. :class:`ReadOnlyTensor` refuses in-place
operations (``add_``, ``h[0] = ...``, ``out=``) on itself and on every view taken from it;
anything that allocates new memory (``.clone()``, ``.float()`` of bf16, arithmetic) comes out as
a plain, writable tensor.
"""

from __future__ import annotations

import torch

# In-place operator methods whose names do not end in "_".
_INPLACE_DUNDERS = frozenset(
    f"__i{op}__" for op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul",
                            "and", "or", "xor", "lshift", "rshift")
) | {"__setitem__"}
_HARMLESS = frozenset({"requires_grad_", "retain_grad"})


def _name(func) -> str:
    return getattr(func, "__name__", "") or ""


def _is_inplace(func) -> bool:
    name = _name(func)
    if name in _HARMLESS:
        return False
    return name in _INPLACE_DUNDERS or (name.endswith("_") and not name.startswith("_"))


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors(x)


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class ReadOnlyTensor(torch.Tensor):
    """A tensor whose memory belongs to a loaded shard: in-place writes raise ``ValueError``."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            targets = list(_tensors(kwargs.get("out")))
            if _is_inplace(func) and args and isinstance(args[0], torch.Tensor):
                targets.append(args[0])
            if any(isinstance(t, ReadOnlyTensor) for t in targets):
                raise ValueError(
                    f"{_name(func) or 'this operation'} would write into a read-only view of a shard's memory "
                    "(Sample.hidden / tokens().hidden); .clone() it first"
                )
            protected = {_storage(t) for t in _tensors((args, list(kwargs.values()))) if isinstance(t, ReadOnlyTensor)}
            out = func(*args, **kwargs)
            return _protect(out, protected)

    def numpy(self, *args, **kwargs):
        with torch._C.DisableTorchFunctionSubclass():
            a = torch.Tensor.numpy(self, *args, **kwargs)
        a.flags.writeable = False
        return a


def _protect(out, protected: set[int]):
    """Results that alias a read-only tensor's memory stay read-only; new memory is returned plain."""
    if isinstance(out, torch.Tensor):
        aliased = out.numel() > 0 and _storage(out) in protected
        if aliased and not isinstance(out, ReadOnlyTensor):
            return out.as_subclass(ReadOnlyTensor)
        if not aliased and isinstance(out, ReadOnlyTensor):
            return out.as_subclass(torch.Tensor)
        return out
    if isinstance(out, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in out):
        items = [_protect(x, protected) for x in out]
        return type(out)(items) if isinstance(out, list) or type(out) is tuple else type(out)(*items)
    return out


def read_only(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a :class:`ReadOnlyTensor` (same memory, no copy)."""
    with torch._C.DisableTorchFunctionSubclass():
        return t.as_subclass(ReadOnlyTensor)
