"""kvmesh's C kernels for CPU (workers/csrc/*.c), compiled on first use and loaded with ctypes.

The kernels are AVX-512 code (x86-64 servers since Skylake-SP / Zen 4). Where the CPU has
AVX-512, the sources are compiled with the system C compiler (`$CC`, default `cc`) for this CPU
(`-march=native`, OpenMP) into one shared library in a per-user cache
(`$KVMESH_CACHE_DIR`, default ~/.cache/kvmesh), keyed by the sources, the compiler and the CPU's
flags, then loaded with ctypes, which releases the GIL during a call. torch is imported first,
so the library's libgomp.so.1 binds to torch's copy: one OpenMP thread pool in the process.

On other CPUs, without a compiler, or with `KVMESH_CPU_KERNELS=0`, `kernel_library()` is None
and every caller keeps its pure-torch path (model.py's float32 weights, attention.py's SDPA).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch  # noqa: F401  (loaded before the library: see the module docstring)

logger = logging.getLogger(__name__)

SOURCES = sorted((Path(__file__).parent / "csrc").glob("*.c"))
_LIB_NAME = "libkvmesh_cpu.so"


def _cache_dir() -> Path:
    root = os.environ.get("KVMESH_CACHE_DIR") or Path.home() / ".cache" / "kvmesh"
    return Path(root) / "kernels"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _build(cc: str) -> Path | None:
    """Compile the sources (once per source text, compiler and CPU); the .so's path, or None."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    texts = [p.read_text() for p in SOURCES]
    # Without OpenMP (e.g. clang lacking libomp) the kernels still run, on one thread.
    for extra in (["-fopenmp"], []):
        flags = ["-O3", "-march=native", "-shared", "-fPIC", *extra]
        key = hashlib.sha256("\0".join([*texts, version, *flags, _cpu_flags()]).encode())
        out = _cache_dir() / key.hexdigest()[:16] / _LIB_NAME
        if out.exists():
            return out
        out.parent.mkdir(parents=True, exist_ok=True)
        # Build beside the target, then rename: workers on one node may build at once.
        fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".so")
        os.close(fd)
        cmd = [cc, *flags, "-o", tmp, *map(str, SOURCES)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode == 0:
            os.replace(tmp, out)
            return out
        os.unlink(tmp)
        logger.warning("compiling the CPU kernels with %s failed:\n%s", flags, proc.stderr[-2000:])
    return None


def _declare(lib: ctypes.CDLL) -> None:
    i32, i64, ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
    signatures = {
        "kvq_packed_bytes": (i64, [i32, i64, i64]),
        "kvq_repack": (i32, [i32, ptr, i64, i64, ptr]),
        "kvq_matmul": (i32, [i32, ptr, i64, i64, ptr, i64, ptr, i32]),
        "kva_paged_attention": (i32, [ptr] * 5 + [i32] * 6 + [ptr] * 6 + [ctypes.c_float, i32]),
    }
    for name, (res, args) in signatures.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args


@functools.cache
def kernel_library() -> ctypes.CDLL | None:
    """The compiled kernels, or None when they are disabled or cannot be built here."""
    if os.environ.get("KVMESH_CPU_KERNELS", "1") == "0":
        return None
    if "avx512f" not in _cpu_flags().split():
        logger.info("this CPU has no AVX-512: the CPU kernels are off (pure torch instead)")
        return None
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        logger.warning("no C compiler found: the CPU kernels are off (pure torch instead)")
        return None
    try:
        path = _build(cc)
        if path is None:
            return None
        lib = ctypes.CDLL(str(path))
        _declare(lib)
    except (OSError, AttributeError) as e:
        logger.warning("loading the CPU kernels failed (%s): pure torch instead", e)
        return None
    return lib


def require_library() -> ctypes.CDLL:
    lib = kernel_library()
    if lib is None:
        raise RuntimeError("kvmesh's CPU kernels are not available on this machine")
    return lib
