"""CPU row kernels in C++ over ATen's vectorized math (``head_row.h``): torch ops ``torch.ops.nmst_fast_cpu.*``
(``row_lse.cpp``, ``loss_rows.cpp``), the decoding step's selection (``select_rows.cpp``, a function of the
extension module) and, in the same library, the head as a llama.cpp sampler (``llama_sampler.cpp``, C functions
called through ctypes: :func:`native_library`).

They are built on first use by torch's JIT extension builder (a C++ compiler and ninja; a few
seconds, once per machine: the build is cached under ``TORCH_EXTENSIONS_DIR``, by default
``~/.cache/torch_extensions``) for the CPU capability torch itself dispatches to (AVX-512, AVX2, or
portable code). Where the build fails, or ``NMST_FAST_CPU_KERNELS=0`` is set, :func:`row_kernels`
returns None (logged once) and callers compute the same values with torch ops.

Ops, on float32 CPU tables with unit column stride (any row stride), float64 and int64 (A,) CPU
vectors:
    ``non_eos_lse(rows, skip, inverse) -> Tensor``: (A,) float64 log Σ_{v ≠ skip} exp(rows[a, v]·inverse[a])
    of ``rows`` (A, V) (``inverse`` None: 1), two passes over each row (max, then Σ exp2), nothing
    written but the result. A row whose max is not finite gets max·inverse (+inf; −inf with no finite
    entry), NaN with any NaN entry.
    ``write_eos_column(logits, rows, eos, temperatures, steps, before, eps, max_gap) -> Tensor``: writes
    the vLLM processor's eos column into rows ``rows`` (int64 indices) of ``logits`` in place, NMST
    (``before`` None) or ST rows at one step (``steps`` t per row), as
    ``nmst_fast.integrations.vllm.eos_column.host_eos_value`` computes it from the row pass's L_T
    (rows without a distribution keep theirs); returns ST's running sums after the step (A,) float64
    (empty for NMST).

The decoding step's selection is a function of the extension module (:func:`native_module`), called through pybind11
rather than torch's dispatcher (a step's call comes after a forward pass has evicted the caches, where a dispatched
call cost ~20 µs and this one ~5 µs):
    ``select_rows(logits, vocab, head, eos, eps, temperature, steps, step, state, top_k, cut, min_p, generator)``:
    one decoding step's token per row of ``logits`` (B, V) (``select_rows.cpp``; :mod:`nmst_fast.decoding.cpu_rows`
    documents the arguments): (tokens (B,) int64, log p (B,) float64, ST's state after the step (B,) float64 or
    None, the first row without a distribution or -1), or None where the logits are not ones it serves.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import re
import shutil
import time
from pathlib import Path
from types import ModuleType
from typing import Any, Iterator, Optional

import torch

logger = logging.getLogger("nmst_fast")

SOURCES = [Path(__file__).with_name(name)
           for name in ("row_lse.cpp", "loss_rows.cpp", "select_rows.cpp", "llama_sampler.cpp")]
DISABLE_ENV = "NMST_FAST_CPU_KERNELS"

# The compiler flags of torch's own kernels for each CPU capability it dispatches to; ATen's vector
# headers pick their implementation from the CPU_CAPABILITY_* macro.
CAPABILITY_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
}


def build_flags(capability: str) -> list[str]:
    """The C++ flags for ``capability`` (torch's name: "AVX512", "AVX2"; any other builds portable code)."""
    # -ffp-contract=off: no fused multiply-adds the source does not write, so the head's float64 scalars
    # round as the library's Python formulas do. -fopenmp: at::parallel_for is an OpenMP loop only where _OPENMP
    # is defined (ATen/ParallelOpenMP.h); without it every kernel ran on one thread whatever torch's thread count.
    # The library then takes torch's own OpenMP runtime (libgomp.so.1, loaded with torch), whose thread count
    # torch.set_num_threads sets.
    common = ["-O3", "-ffp-contract=off", "-fopenmp"]
    if capability not in CAPABILITY_FLAGS:
        return [*common, "-DCPU_CAPABILITY=DEFAULT"]
    return [*common, f"-DCPU_CAPABILITY={capability}", f"-DCPU_CAPABILITY_{capability}", *CAPABILITY_FLAGS[capability]]


def library_name(capability: str) -> str:
    """The name of the kernels' shared library for ``capability`` (one per capability and torch version)."""
    return re.sub(r"\W", "_", f"nmst_fast_cpu_{capability}_torch{torch.__version__}").lower()


def build(capability: Optional[str] = None) -> ModuleType:
    """Build (or load the cached build of) the kernels for ``capability`` (default: torch's own) and return the
    extension module (its ``select_rows``; loading it registers the ops ``torch.ops.nmst_fast_cpu``); raises what the
    build raises."""
    from torch.utils import cpp_extension

    capability = capability or torch.backends.cpu.get_cpu_capability()
    name = library_name(capability)
    path = os.environ.get("PATH", "")
    try:
        os.environ["PATH"] = _with_ninja(path)
        with _build_held(_build_directory(capability)):
            return cpp_extension.load(name=name, sources=[str(source) for source in SOURCES],
                                      extra_cflags=build_flags(capability), extra_ldflags=["-fopenmp"],
                                      is_python_module=True, verbose=False)
    finally:
        os.environ["PATH"] = path


@contextlib.contextmanager
def _build_held(directory: Path) -> Iterator[None]:
    """Hold the build ``directory`` against other processes building these kernels, with a lock the system releases
    when its holder dies, and clear a lock file torch's builder left there. torch's builder waits, without end, for
    its own lock file (``lock``) to go; a build killed while it held it (a Ctrl-C during the first build) leaves it
    behind, and every later import of the kernels waited forever. Every build of these kernels takes this lock first,
    so torch's lock file, where this one is held, is such a leftover."""
    try:
        import fcntl
    except ImportError:  # no POSIX locks: torch's own lock file alone
        yield
        return
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "nmst_fast.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        (directory / "lock").unlink(missing_ok=True)
        yield


@functools.lru_cache(maxsize=None)
def native_module() -> Optional[ModuleType]:
    """The kernels' extension module for torch's CPU capability, built on the first call; None (logged once) when
    ``NMST_FAST_CPU_KERNELS=0`` or the build fails."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        logger.info("%s=0: the CPU row kernels are off; torch ops compute their values", DISABLE_ENV)
        return None
    capability = torch.backends.cpu.get_cpu_capability()
    first = not _built_before(capability)
    if first:
        logger.warning("nmst_fast: building the CPU kernels for %s (once per machine and torch version, kept in %s; "
                       "about 10-60 s)", capability, _build_directory(capability))
    try:
        start = time.perf_counter()
        module = build(capability)
        if first:
            logger.warning("nmst_fast: the CPU kernels are built (%.0f s)", time.perf_counter() - start)
        return module
    except Exception as err:  # no compiler, no ninja, no Python headers: torch ops do the same work
        logger.warning("nmst_fast: the CPU row kernels could not be built (%s: %s); torch ops compute the same "
                       "values, more slowly (set %s=0 to skip the build)", type(err).__name__,
                       str(err).strip().splitlines()[-1] if str(err).strip() else "", DISABLE_ENV)
        return None


def row_kernels() -> Optional[Any]:
    """``torch.ops.nmst_fast_cpu`` for torch's CPU capability (:func:`native_module` built), or None where that is
    None."""
    return None if native_module() is None else torch.ops.nmst_fast_cpu


def _build_directory(capability: str) -> Path:
    from torch.utils import cpp_extension

    return Path(cpp_extension._get_build_directory(library_name(capability), verbose=False))


def _built_before(capability: str) -> bool:
    """Whether a build of the kernels for ``capability`` is in the build directory (torch's builder still rebuilds
    it, quickly or not, where the sources changed)."""
    return any(_build_directory(capability).glob(f"{library_name(capability)}*.so"))


@functools.lru_cache(maxsize=None)
def native_library() -> Optional[ctypes.CDLL]:
    """The kernels' shared library for ctypes (its C functions: the llama.cpp sampler), or None where
    :func:`native_module` is None."""
    module = native_module()
    return None if module is None else ctypes.CDLL(module.__file__)


def _with_ninja(path: str) -> str:
    """PATH for torch's builder, which runs ``ninja`` from it: with the pip package's binary added when
    PATH has none (its virtualenv not activated)."""
    if shutil.which("ninja", path=path) is not None:
        return path
    try:
        import ninja
    except ImportError:
        return path
    return os.pathsep.join([ninja.BIN_DIR, path])
