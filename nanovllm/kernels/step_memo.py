"""Once-per-step values for the torch (CPU) kernels.

Every layer of a step gets the same Context tensors (positions, slot mapping, block
tables, sequence lengths), so what a kernel derives from them alone (RoPE's cos/sin
rows, the slot check, the decode gather plan, a mixed step's split) is the same for
every layer. `once_per_step` keeps the last such value per name and thread (two engines
stepping in two threads must not share it) with the key it was made from: tensors are
compared by identity, other key items by value. The kept key holds its tensors alive,
so their identity cannot be reused until the next step's replace them.
"""
import threading
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")
_local = threading.local()


def once_per_step(name: str, key: tuple, compute: Callable[[], T]) -> T:
    """`compute()`, or the value it gave for the same `key` the last time `name` was asked."""
    last = getattr(_local, name, None)
    if last is not None and _same_key(last[0], key):
        return last[1]
    value = compute()
    setattr(_local, name, (key, value))
    return value


def _same_key(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(x is y if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b))
