"""Random ids for requests, tool calls and batch lines, drawn without a system call.

`uuid.uuid4()` reads `os.urandom` on every call, and `os.urandom` lets go of the GIL
around its `getrandom` system call. On the server's event loop that hands the GIL to
the engine thread, and the loop then waits to win it back: beside a busy thread one
`uuid4()` took ~0.2 ms on a 2-core VM against 2 us alone, and every request of a burst
paid it before it reached the engine (benchmarks/RESULTS.md, "Thirtieth session").

These ids come from one generator of this process, seeded from `os.urandom` once and
again in a forked child, so that two processes never draw the same sequence. They are
unique, not secret, which is all an id the client only reads back needs.
"""
import os
import random

_generator = random.Random()   # seeded from os.urandom
os.register_at_fork(after_in_child=_generator.seed)


def random_hex(num_digits: int = 32) -> str:
    """`num_digits` random hexadecimal digits (32 by default, as many as `uuid4().hex`)."""
    return f"{_generator.getrandbits(4 * num_digits):0{num_digits}x}"
