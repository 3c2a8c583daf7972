"""Whether a C++ compiler is here for the code torch Inductor builds on the CPU.

Two users: the compiled CPU forward (engine/cpu_compile.py) and the paged decode attention
kernel (kernels/cpu_paged_decode.py), which Inductor's C++ code cache builds at start-up.
Without a compiler both keep their torch-only paths. The search imports Inductor (~1 s), so
it runs once, and only where one of them is about to be used.
"""
import functools


@functools.cache
def cpp_compiler_found() -> bool:
    """Whether Inductor's own search finds a C++ compiler to build its CPU code with."""
    from torch._inductor import cpp_builder
    try:
        cpp_builder.get_cpp_compiler()
    except Exception:  # torch's InvalidCxxCompiler, or an OSError running a candidate
        return False
    return True
