"""A pytest plugin: every Triton kernel run under the interpreter runs its grid's programs last to first.

The interpreter runs a launch's programs one after another in grid order, so a kernel whose programs
depend on each other's writes (which on a GPU is a race) passes its tests there. Running the kernel
tests once more in reverse order shows such a dependency:

    TRITON_INTERPRET=1 PYTHONPATH=tests python -m pytest -p reverse_program_order tests/test_triton_attn.py ...
"""
from triton.runtime import interpreter

from triton_interpreter import reversed_grid_idx

interpreter.InterpreterBuilder.set_grid_idx = reversed_grid_idx(interpreter.InterpreterBuilder.set_grid_idx)
