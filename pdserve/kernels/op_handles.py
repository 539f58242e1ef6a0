"""Integer handles for what a compiled graph's opaque operators read but must not take as inputs.

The compiled decode step (``engine/execution/compiled_step.py``) calls some operators with an int naming their
weights instead of the weights themselves: oneDNN-packed weights (torch.compile cannot take their
``_mkldnn`` layout as a graph input), the panel kernel's panels and a MoE layer's experts (so dynamo
neither guards nor passes those tensors every step). A handle is a constant of the graph; each
``CompiledDecodeStep`` compiles a code object of its own, so one model's handles never reach
another model's step.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Generic, TypeVar

T = TypeVar("T")


class OpHandles(Generic[T]):
    """handle -> object, held weakly: the owner (a layer) keeps the object alive, and a dropped model frees it.

    ``register(obj)`` returns a new int handle; ``handles[h]`` returns the object, or raises KeyError for a
    handle whose object was freed."""

    def __init__(self) -> None:
        self._objects: weakref.WeakValueDictionary[int, T] = weakref.WeakValueDictionary()
        self._next = itertools.count()

    def register(self, obj: T) -> int:
        handle = next(self._next)
        self._objects[handle] = obj
        return handle

    def __getitem__(self, handle: int) -> T:
        return self._objects[handle]

    def items(self) -> list[tuple[int, T]]:
        """(handle, object) for every object still alive."""
        return list(self._objects.items())
