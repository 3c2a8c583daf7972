"""C++ code built at run time: whether a compiler is here, and building a source once per machine.

Its users: the compiled CPU forward (engine/cpu_compile.py, Inductor's own code) and the C++
kernels of kernels/ (cpu_paged_decode.py, cpu_small_ops.py), whose sources `source` assembles (the
build's macros, the file, the headers it includes from beside it) and `build` compiles through
Inductor's C++ code cache (`CppPythonBindingsCodeCache`: the compiler torch.compile finds, no
ninja, OpenMP, the CPU's vector ISA, `-march=native`; `-march=x86-64-v3`, AVX2 at most, where
ATEN_CPU_CAPABILITY is "avx2": utils/device.py). Without a compiler each keeps its torch-only path.

Asking Inductor costs ~3.4 s in every process even when its disk cache holds the library: importing
`torch._inductor.codecache` (~1.9 s) and its vector-ISA probe (~1.5 s of small builds loaded in
subprocesses) (benchmarks/RESULTS.md "B2 CPU, round 12"). So `build` keeps a copy of each library
it got, named by a hash of the source, its argument types, torch's and Python's versions and the
CPU's flags, and later processes load that copy directly (a few ms): the same binding module, given
the one pointer it asks torch for, as Inductor's loader does.
"""
import contextlib
import functools
import getpass
import hashlib
import importlib.util
import logging
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from nanovllm.utils.device import cpu_flags, cpu_limited_to_avx2

logger = logging.getLogger(__name__)

# The ISA level the libraries are built for where ATEN_CPU_CAPABILITY limits the CPU to AVX2
# (AVX2, FMA, F16C: -march=native would let the compiler use the newer instructions the CPU has)
AVX2_MARCH = "x86-64-v3"
# A kernel source's include of a header kept beside it (cpu_vec_floats.h), on a line of its own
LOCAL_INCLUDE = re.compile(r'^#include "([\w.]+)".*$', re.M)


@functools.cache
def cpp_compiler_found() -> bool:
    """Whether Inductor's own search finds a C++ compiler to build its CPU code with."""
    from torch._inductor import cpp_builder
    try:
        cpp_builder.get_cpp_compiler()
    except Exception:  # torch's InvalidCxxCompiler, or an OSError running a candidate
        return False
    return True


def build(source: str, arg_types: list[str]):
    """The C++ function `kernel` of `source` as a Python function (pointers passed as tensors,
    `long` as int, `float` as float), or None where it cannot be built (no compiler, a build error:
    logged at debug level only, the callers have a torch path)."""
    library = library_dir() / f"{_key(source, arg_types)}.so"
    if library.exists():
        try:
            return _load(library)
        except (ImportError, OSError) as e:  # a broken copy: built again below
            logger.debug("cpp_compiler: %s did not load: %s", library, e)
    if not cpp_compiler_found():
        return None
    from torch._inductor import config
    from torch._inductor.codecache import CppPythonBindingsCodeCache
    march = config.patch({"cpp.march": AVX2_MARCH}) if cpu_limited_to_avx2() else contextlib.nullcontext()
    try:
        with march:
            fn = CppPythonBindingsCodeCache.load_pybinding(arg_types, source)
    except Exception as e:
        logger.debug("cpp_compiler: build failed: %s", e)
        return None
    _keep(fn, library)
    return fn


def source(path: Path, macros: dict[str, object]) -> str:
    """The C++ source that `build` compiles from the file at `path`: `#define NAME value` for each of
    `macros`, then the file, with each `#include "NAME"` line replaced by the text of that file beside
    it (Inductor compiles the text in a directory of its own, and the library's hash must cover it)."""
    defines = "".join(f"#define {name} {value}\n" for name, value in macros.items())
    return defines + LOCAL_INCLUDE.sub(lambda m: (path.parent / m.group(1)).read_text(), path.read_text())


def library_dir() -> Path:
    """Where the built libraries are kept: beside Inductor's cache (TORCHINDUCTOR_CACHE_DIR, else
    its default, /tmp/torchinductor_<user>), not imported from Inductor (that import is the cost)."""
    root = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not root:
        try:
            user = getpass.getuser()
        except (KeyError, OSError):
            user = f"uid_{os.getuid()}"
        root = os.path.join(tempfile.gettempdir(), f"torchinductor_{user}")
    return Path(root) / "nanovllm"


def _key(source: str, arg_types: list[str]) -> str:
    """What the built library depends on: the source and its bindings, torch, Python, the CPU."""
    parts = [source, *arg_types, torch.__version__, sys.version, " ".join(sorted(cpu_flags()))]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:40]


def _load(library: Path):
    """Load a library that Inductor built: its module init reads, from an environment variable,
    the address of torch's function that gives a tensor's data pointer (as Inductor's loader sets it)."""
    os.environ["_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR"] = str(
        torch._C._dynamo.guards._torchinductor_pyobject_tensor_data_ptr)
    name = f"nanovllm_{library.stem}.kernel"  # (the last part names the module's init function)
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, library)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
    return sys.modules[name].kernel


def _keep(fn, library: Path) -> None:
    """Copy the library that holds `fn` to `library` (written aside, then renamed: another process
    may read it at the same moment)."""
    module = next((m for m in list(sys.modules.values()) if getattr(m, "__dict__", {}).get("kernel") is fn), None)
    if module is None or not getattr(module, "__file__", None):
        return
    try:
        library.parent.mkdir(parents=True, exist_ok=True)
        partial = library.with_suffix(f".{os.getpid()}.tmp")
        shutil.copyfile(module.__file__, partial)
        os.replace(partial, library)
    except OSError as e:  # (a read-only cache directory: Inductor's path is taken each time)
        logger.debug("cpp_compiler: could not keep %s: %s", library, e)
