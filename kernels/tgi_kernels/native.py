"""Our C++ CPU kernels (csrc/*.cpp): built once per machine, cached, loaded.

`native_ops()` returns `torch.ops.tgi` with the kernels registered, or None
where they cannot be had (no C++ compiler, a failed build, a non-x86 torch
build we have not tried): callers then keep their plain torch path, and the
reason is logged once.

The library is compiled with -march=native for the CPU at hand (AVX2 or
AVX-512, bf16 instructions where present), so its cache key holds the CPU's
flags as well as the sources, the compiler flags and the torch version: a
machine handed to a later session with another CPU builds its own. It is
built by `make install` (python -m tgi_kernels.native) and in the Docker
image, else on first use (docs/tuning.md#native-build), never at every start;
concurrent shards of one group wait on a file lock for one build.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from .native_fakes import register_fakes

log = logging.getLogger("tgi_kernels")

SOURCES = Path(__file__).with_name("csrc")
# -fopenmp: at::parallel_for is inline and spreads work over threads only
# where OpenMP is on; the library then shares torch's own libgomp (one
# runtime, one thread pool: the soname is already loaded when it loads).
# -fno-trapping-math: no kernel reads the FP exception flags; without it GCC
# 12 keeps exp_approx's clamps as branches on AVX2 (AVX-512 masks them), so
# every loop over it (silu_mul, the AVX2 softmax) stayed scalar (figures:
# docs/tuning.md#native-build). Results move only where a sum now vectorizes
# (its order of additions: float32 rounding).
CXXFLAGS = ["-O3", "-march=native", "-std=c++20", "-fPIC", "-fopenmp", "-fno-trapping-math", "-DNDEBUG", "-w"]
LIBRARY = "tgi_cpu"


def cache_root() -> Path:
    """Where built libraries live: $XDG_CACHE_HOME/tgi_kernels (~/.cache by default)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tgi_kernels"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def machine_tag() -> str:
    """16 hex digits of torch's version, the CPU's flags and the kernels ATen
    dispatches (ATEN_CPU_CAPABILITY may lower them): what code generated for
    this machine depends on, for caches that do not key on it themselves."""
    h = hashlib.sha256()
    for part in (torch.__version__, _cpu_flags(), torch.backends.cpu.get_cpu_capability()):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:16]


def _sources() -> list[Path]:
    return sorted(SOURCES.glob("*.cpp"))


def _key(compiler: str) -> str:
    h = hashlib.sha256()
    for part in (compiler, " ".join(CXXFLAGS), torch.__version__, _cpu_flags()):
        h.update(part.encode() + b"\0")
    for src in _sources() + sorted(SOURCES.glob("*.h")):
        h.update(src.name.encode() + b"\0" + src.read_bytes())
    return h.hexdigest()[:16]


def _compile(compiler: str, out: Path) -> None:
    from torch.utils.cpp_extension import include_paths, library_paths

    includes = [f"-I{p}" for p in include_paths()] + [f"-I{SOURCES}"]
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        objects = [Path(tmp) / (src.stem + ".o") for src in _sources()]

        def one(pair: tuple[Path, Path]) -> None:
            src, obj = pair
            _run([compiler, *CXXFLAGS, *includes, "-c", str(src), "-o", str(obj)])
        with ThreadPoolExecutor(max(1, min(len(objects), os.cpu_count() or 1))) as pool:
            list(pool.map(one, zip(_sources(), objects)))
        lib = library_paths()[0]
        partial = Path(tmp) / "lib.so"
        _run([compiler, "-shared", "-fopenmp", *map(str, objects), f"-L{lib}", f"-Wl,-rpath,{lib}",
              "-lc10", "-ltorch_cpu", "-o", str(partial)])
        os.replace(partial, out)  # atomic: a reader never sees half a library


def _run(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd[:2])} ... failed:\n{done.stderr[-4000:]}")


def find_compiler() -> str | None:
    """The C++ compiler: $CXX, else g++, c++ or clang++ on PATH; None without one."""
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


def build(root: Path | None = None) -> Path:
    """Builds the library for this machine unless cached; returns its path.
    Raises RuntimeError when no compiler is found or the build fails."""
    compiler = find_compiler()
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++, c++ or clang++) on PATH")
    root = root or cache_root()
    target = root / _key(compiler) / f"lib{LIBRARY}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not target.exists():
            log.info("building the C++ CPU kernels into %s (once per machine)", target.parent)
            _compile(compiler, target)
    return target


_UNLOADED = object()
_ops = _UNLOADED


def native_ops():
    """torch.ops.tgi with our CPU kernels, or None (logged once) where they
    cannot be built. Loaded at the first call; later calls read a global,
    which torch.compile traces as a constant (a cached function's body it
    would trace, file checks and all)."""
    global _ops
    if _ops is _UNLOADED:
        _ops = _load()
    return _ops


def _load():
    if sys.platform != "linux":
        log.info("C++ CPU kernels off: built on Linux only; plain torch kernels instead")
        return None
    try:
        torch.ops.load_library(str(build()))
    except (RuntimeError, OSError) as e:
        log.warning("C++ CPU kernels off (plain torch kernels instead): %s", e)
        return None
    register_fakes(torch.ops.tgi)
    return torch.ops.tgi


if __name__ == "__main__":  # builds the library ahead of the first start
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(build())
