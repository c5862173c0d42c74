"""kvmesh's C kernels for CPU (workers/csrc/*.c), compiled on first use and loaded with ctypes.

The kernels have an AVX-512 build (x86-64 servers since Skylake-SP / Zen 4) and an AVX2 + FMA
build (x86-64 since Haswell / Zen 1: most laptops and many cloud CPUs), from the same sources;
both give the same results. The sources are compiled with the system C compiler (`$CC`, default
`cc`) for this CPU (`-march=native`, OpenMP; `-mno-avx512f` on top for the AVX2 build) into one
shared library per build in a per-user cache (`$KVMESH_CACHE_DIR`, default ~/.cache/kvmesh),
keyed by the sources, the compiler, its flags and the CPU's flags, then loaded with ctypes,
which releases the GIL during a call. torch is imported first, so the library's libgomp.so.1
binds to torch's copy: one OpenMP thread pool in the process.

`KVMESH_CPU_ISA` picks the build: `auto` (default: AVX-512 where the CPU has it, else AVX2),
`avx512` or `avx2` (e.g. to run the AVX2 code on an AVX-512 machine). It is read at each call,
so a test or a benchmark can switch builds in one process (the packed weights are the same).
On CPUs with neither, without a compiler, when the build fails, or with `KVMESH_CPU_KERNELS=0`,
`kernel_library()` is None, the reason is logged once, and every caller keeps its pure-torch
path (model.py's float32 weights, attention.py's SDPA).
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


# Build variant -> (CPU flags it needs, compiler flags on top of -march=native).
ISAS: dict[str, tuple[frozenset[str], tuple[str, ...]]] = {
    "avx512": (frozenset({"avx512f", "f16c"}), ()),
    # -mno-avx512f also turns off every AVX-512 extension (they all depend on it).
    "avx2": (frozenset({"avx2", "fma", "f16c"}), ("-mno-avx512f",)),
}
_reported: set[str] = set()


def _off(reason: str, level: int = logging.INFO) -> None:
    """Log once per reason why the kernels are off."""
    if reason not in _reported:
        _reported.add(reason)
        logger.log(level, "CPU kernels off, pure torch instead: %s", reason)


def supported_isas() -> list[str]:
    """The build variants this CPU can run, best first."""
    flags = set(_cpu_flags().split())
    return [isa for isa, (needs, _) in ISAS.items() if needs <= flags]


def _build(cc: str, isa: str) -> Path | None:
    """Compile the sources (once per source text, compiler, flags and CPU); the .so, or None."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    texts = [p.read_text() for p in SOURCES]
    # Without OpenMP (e.g. clang lacking libomp) the kernels still run, on one thread.
    for extra in (["-fopenmp"], []):
        flags = ["-O3", "-march=native", *ISAS[isa][1], "-shared", "-fPIC", *extra]
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
    i32, i64, ptr, f32 = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    signatures = {
        "kvq_packed_bytes": (i64, [i32, i64, i64]),
        "kvq_repack": (i32, [i32, ptr, i64, i64, ptr]),
        "kvq_matmul": (i32, [i32, ptr, i64, i64, ptr, i64, ptr, i32]),
        "kvmesh_isa_bits": (i32, []),
        # ..., scale, threads, kv_dtype
        "kva_paged_attention": (i32, [ptr] * 5 + [i32] * 6 + [ptr] * 6 + [f32, i32, i32]),
        "kvn_rope": (i32, [ptr, i64, ptr, ptr, i64, i64, i64, i32]),
        "kvn_rmsnorm": (i32, [ptr, ptr, ptr, ptr, i64, i64, f32, i32]),
    }
    for name, (res, args) in signatures.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args


def kernel_library(isa: str | None = None) -> ctypes.CDLL | None:
    """The compiled kernels (the `isa` build, default `$KVMESH_CPU_ISA`), or None when they are
    disabled or cannot be built here."""
    if os.environ.get("KVMESH_CPU_KERNELS", "1") == "0":
        _off("KVMESH_CPU_KERNELS=0")
        return None
    return _load(isa or os.environ.get("KVMESH_CPU_ISA") or "auto")


@functools.cache
def _load(isa: str) -> ctypes.CDLL | None:
    if isa != "auto" and isa not in ISAS:
        _off(f"KVMESH_CPU_ISA={isa!r} is none of auto, {', '.join(ISAS)}", logging.WARNING)
        return None
    have = supported_isas()
    if isa == "auto":
        if not have:
            _off("this CPU has neither AVX-512 nor AVX2 + FMA + F16C")
            return None
        isa = have[0]
    elif isa not in have:
        missing = ISAS[isa][0] - set(_cpu_flags().split())
        _off(f"the {isa} build needs {' '.join(sorted(missing))}, which this CPU lacks")
        return None
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        _off("no C compiler found", logging.WARNING)
        return None
    try:
        path = _build(cc, isa)
        if path is None:
            _off(f"compiling the {isa} build failed (see above)", logging.WARNING)
            return None
        lib = ctypes.CDLL(str(path))
        _declare(lib)
    except (OSError, AttributeError) as e:
        _off(f"loading the {isa} build failed ({e})", logging.WARNING)
        return None
    logger.info("CPU kernels: %s build (%s)", isa, path)
    return lib


def require_library() -> ctypes.CDLL:
    lib = kernel_library()
    if lib is None:
        raise RuntimeError("kvmesh's CPU kernels are not available on this machine")
    return lib
