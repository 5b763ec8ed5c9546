"""Which BLAS MLX multiplies with, and running the bench with another one preloaded.

MLX's Linux CPU wheel (`mlx[cpu]`) bundles the reference BLAS (its
`mlx_cpu.libs/libblas-*.so`): about 3 GFLOP/s of float32 matmul on two
cores, behind which every layout overhead hides. A system OpenBLAS
(Debian: `apt-get install libopenblas0-pthread`) preloaded with
`LD_PRELOAD` takes its symbols' place: MLX's matmuls run ~20x faster with
the same results to rounding (tests/core/test_blas.py compares tokens).
macOS builds use Accelerate and preload nothing.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
from pathlib import Path

from kvlayout.errors import ConfigError

ENV = "KVLAYOUT_BLAS"  # the same as `kvlayout bench --blas PATH`
# Where Debian's libopenblas0-pthread puts its libblas.so.3 (the multiarch triplet: x86_64, aarch64).
DEBIAN_OPENBLAS = f"/usr/lib/{platform.machine()}-linux-gnu/openblas-pthread/libblas.so.3"


def mapped_libraries() -> list[str]:
    """Shared libraries mapped into this process, in load order (Linux's /proc/self/maps; [] elsewhere)."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    seen: dict[str, None] = {}
    for line in lines:
        parts = line.split()
        if len(parts) >= 6 and ".so" in parts[-1]:
            seen.setdefault(parts[-1], None)
    return list(seen)


def in_use() -> str:
    """The BLAS MLX's matmuls resolve to, in words: a preloaded library wins over the bundled one."""
    if sys.platform == "darwin":
        return "Accelerate (macOS)"
    blas = [lib for lib in mapped_libraries() if "blas" in Path(lib).name.lower()]
    preloaded = [
        p for p in os.environ.get("LD_PRELOAD", "").replace(":", " ").split() if "blas" in Path(p).name.lower()
    ]
    if preloaded:
        kind = "OpenBLAS" if any("openblas" in lib.lower() for lib in blas) else "preloaded"
        return f"{kind} {preloaded[0]} (LD_PRELOAD)"
    bundled = [lib for lib in blas if "mlx_cpu.libs" in lib]
    if bundled:
        return f"reference BLAS bundled with mlx[cpu] ({Path(bundled[0]).name})"
    return ", ".join(Path(lib).name for lib in blas) or "none mapped (a GPU build, or not loaded yet)"


def check_library(path: str) -> str:
    """`path` if it names a shared library this process can load; ConfigError, one line, otherwise."""
    if sys.platform == "darwin":
        raise ConfigError(f"--blas {path}: macOS builds of MLX use Accelerate; there is no BLAS to preload")
    if not Path(path).is_file():
        hint = f" (Debian: apt-get install libopenblas0-pthread gives {DEBIAN_OPENBLAS})"
        what = "a directory, not a library file" if Path(path).is_dir() else "no such file"
        raise ConfigError(f"--blas {path}: {what}{hint}")
    try:
        library = ctypes.CDLL(path)
    except OSError as exc:
        raise ConfigError(f"--blas {path}: not a loadable shared library ({exc})") from None
    if not hasattr(library, "sgemm_"):
        raise ConfigError(f"--blas {path}: has no sgemm_ symbol; expected a BLAS (libblas.so.3)")
    return str(Path(path).resolve())


def preloaded(path: str) -> bool:
    """Whether `path` is already in this process's LD_PRELOAD (so it is the BLAS in use)."""
    want = Path(path).resolve()
    return any(Path(p).resolve() == want for p in os.environ.get("LD_PRELOAD", "").replace(":", " ").split() if p)


def exec_with(path: str, argv: list[str]) -> None:
    """Replace this process by `kvlayout ARGV` with `path` preloaded (a library must be preloaded before
    the process starts: MLX has resolved its BLAS symbols by the time any command runs)."""
    env = dict(os.environ)
    env["LD_PRELOAD"] = " ".join([path, *env.get("LD_PRELOAD", "").replace(":", " ").split()])
    code = "import sys; from kvlayout.cli import main; sys.exit(main())"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-c", code, *argv], env)
