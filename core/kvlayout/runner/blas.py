"""The BLAS MLX's CPU matmuls run on, and a fast one by default on Linux.

MLX's Linux CPU wheel (`mlx[cpu]`) bundles the reference BLAS (its
`mlx_cpu.libs/libblas-*.so`): 3-6 GFLOP/s of float32 matmul on two cores,
behind which everything else hides. An OpenBLAS preloaded with `LD_PRELOAD`
takes the place of its symbols (`cblas_sgemm`, what MLX calls) and runs the
same matmuls 40-60x faster, to rounding. A library must be preloaded before
the process starts, so `kvlayout run`, `serve` and `bench` re-execute
themselves once, before any model loads (`ensure`):

1. `--blas PATH` or `KVLAYOUT_BLAS=PATH`: that library; one that fails its
   check is refused (exit 2, one line). `--blas none` / `KVLAYOUT_BLAS=none`:
   the bundled reference BLAS, nothing preloaded.
2. Otherwise the first library of `candidates()` that passes its check: a
   system OpenBLAS (Debian's and Ubuntu's libopenblas0-pthread or -openmp,
   Fedora's openblas), then the OpenBLAS installed with kvlayout from the
   package index (`ngsolve-openblas`, x86_64 Linux). One that fails is named
   in one line and not used; none passing leaves the reference BLAS.

The check (`check`) runs once per library and machine (the verdict is kept in
the kvlayout cache): in a child process with the library preloaded, a
float32 matmul through MLX must equal numpy's, and the library must be the
one mapped. A crash (an illegal instruction on an older CPU), a wrong answer
or a library that does not load is a failed check.

The package index's OpenBLAS links `libgfortran.so.5`, which a machine with
only Python may lack; MLX's wheel bundles one under another name, so a
directory of links to MLX's bundled libraries (`libgfortran.so.5` among them)
joins `LD_LIBRARY_PATH` when the system has none. macOS builds use
Accelerate, and a build without the bundled reference BLAS (a GPU build) is
left alone: nothing is preloaded there.
"""

from __future__ import annotations

import ctypes.util
import glob
import hashlib
import importlib.util
import json
import os
import platform
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import attrs

from kvlayout.errors import ConfigError, one_line
from kvlayout.models.store import cache_root

ENV = "KVLAYOUT_BLAS"  # PATH, "none", or unset ("auto"): the same as --blas
CHOSEN = "KVLAYOUT_BLAS_CHOSEN"  # set on the re-executed process: the choice is made, don't make it again
TRIPLET = f"{platform.machine()}-linux-gnu"
# Where distributions install a CBLAS-exporting OpenBLAS, best first.
SYSTEM_OPENBLAS = (
    f"/usr/lib/{TRIPLET}/openblas-pthread/libblas.so.3",  # Debian, Ubuntu: libopenblas0-pthread
    f"/usr/lib/{TRIPLET}/openblas-openmp/libblas.so.3",  # libopenblas0-openmp
    f"/usr/lib/{TRIPLET}/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",  # Fedora, RHEL: openblas
    "/usr/lib/libopenblas.so.0",  # Arch
)
DEBIAN_OPENBLAS = SYSTEM_OPENBLAS[0]
PACKAGE = "ngsolve_openblas"  # the package index's OpenBLAS with unprefixed CBLAS symbols (ngsolve-openblas)
VERDICTS = "blas.json"  # under the kvlayout cache: {key: "ok" or why not}

# Run in the child with the library preloaded: a matmul MLX does on the CPU, checked against numpy,
# and the path of the library serving cblas_sgemm (the one mapped whose name says BLAS, preloaded first).
PROBE = """
import ctypes, os, numpy as np, mlx.core as mx
rng = np.random.default_rng(0)
a, b = rng.standard_normal((96, 80), np.float32), rng.standard_normal((80, 72), np.float32)
got = np.array(mx.matmul(mx.array(a), mx.array(b), stream=mx.cpu))
want = a.astype(np.float64) @ b.astype(np.float64)
path = os.path.realpath(os.environ["KVLAYOUT_BLAS_CHOSEN"])
mapped = path in open("/proc/self/maps").read()
if not hasattr(ctypes.CDLL(path), "cblas_sgemm"):
    print("not a CBLAS: it has no cblas_sgemm, what MLX calls")
elif not mapped:
    print("not preloaded: the loader ignored it (another architecture?)")
elif not np.allclose(got, want, rtol=1e-4, atol=1e-4):
    print("wrong: a float32 matmul with it disagrees with numpy's")
else:
    print("ok")
"""


@attrs.frozen
class Choice:
    """The library to preload (None: the bundled reference BLAS), the environment that preloads it,
    and one line per library that was passed over."""

    path: str | None
    env: Mapping[str, str] = attrs.field(factory=dict)
    passed_over: tuple[str, ...] = ()


def applies() -> bool:
    """Whether there is a BLAS to choose: Linux, and MLX's CPU wheel with its bundled reference BLAS."""
    return sys.platform.startswith("linux") and bool(bundled_libraries())


def bundled_libraries() -> list[Path]:
    """The shared libraries MLX's CPU wheel bundles (`mlx_cpu.libs`), found without importing MLX."""
    spec = importlib.util.find_spec("mlx")
    if spec is None or not spec.submodule_search_locations:
        return []
    site = Path(next(iter(spec.submodule_search_locations))).parent
    return sorted((site / "mlx_cpu.libs").glob("*.so*"))


def package_openblas() -> str | None:
    """The OpenBLAS library of the `ngsolve-openblas` package, when it is installed."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    found = sorted(glob.glob(os.path.join(next(iter(spec.submodule_search_locations)), "libopenblas*.so*")))
    return found[0] if found else None


def candidates() -> list[str]:
    """The libraries `auto` tries, in order: system OpenBLAS installs that exist, then the package's."""
    found = [p for p in SYSTEM_OPENBLAS if Path(p).is_file()]
    packaged = package_openblas()
    return found + ([packaged] if packaged else [])


def preload_env(path: str, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The variables that preload `path`: LD_PRELOAD, and LD_LIBRARY_PATH with links to MLX's bundled
    libgfortran when the system has no libgfortran.so.5 of its own."""
    env = {"LD_PRELOAD": " ".join([path, *environ.get("LD_PRELOAD", "").replace(":", " ").split()])}
    if ctypes.util.find_library("gfortran") is None:
        try:
            links = gfortran_links()
        except OSError:  # a cache that cannot be written: no links, and a library needing them fails its check
            links = None
        if links is not None:
            env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(links), environ.get("LD_LIBRARY_PATH")]))
    return env


def gfortran_links() -> Path | None:
    """A directory of links to MLX's bundled libraries, its libgfortran also as `libgfortran.so.5`
    (the name an OpenBLAS asks for); None when MLX bundles none."""
    bundled = bundled_libraries()
    gfortran = [p for p in bundled if p.name.startswith("libgfortran")]
    if not gfortran:
        return None
    where = cache_root() / "blas-libs" / hashlib.sha256(str(gfortran[0]).encode()).hexdigest()[:12]
    where.mkdir(parents=True, exist_ok=True)
    # Every bundled library by its own name: the bundled libgfortran finds its libquadmath beside it ($ORIGIN).
    for target, name in [(p, p.name) for p in bundled] + [(gfortran[0], "libgfortran.so.5")]:
        link = where / name
        if not link.is_symlink() or os.readlink(link) != str(target):
            tmp = where / f".{name}.{os.getpid()}"
            tmp.unlink(missing_ok=True)
            tmp.symlink_to(target)
            tmp.replace(link)  # atomic: a process reading the directory never sees it half made
    return where


def check(path: str) -> str | None:
    """None when `path` passes as the BLAS (kept from an earlier check of the same file on this machine),
    else why not, in a few words."""
    key = _verdict_key(path)
    verdicts = _read_verdicts()
    if not isinstance(verdicts.get(key), str):  # unchecked, or a damaged cache's entry
        verdicts[key] = _probe(path)
        _write_verdicts(verdicts)
    verdict = verdicts[key]
    return None if verdict == "ok" else verdict


def _probe(path: str) -> str:
    """"ok", or why `path` fails: run PROBE in a child with it preloaded."""
    env = {**os.environ, **preload_env(path), CHOSEN: path}
    try:
        done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return "a float32 matmul with it preloaded did not finish in 120 s"
    if done.returncode < 0:
        name = signal.Signals(-done.returncode).name
        return f"a float32 matmul with it preloaded died of {name}" + (
            " (built for another CPU)" if name == "SIGILL" else "")
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or [f"exit status {done.returncode}"]
        return f"it does not load ({one_line(lines[-1])[:160]})"
    return done.stdout.strip() or "the check printed nothing"


def _verdict_key(path: str) -> str:
    """The file (its real path, size and time), the CPU and MLX: a verdict stands while all are the same."""
    real = Path(path).resolve()
    stat = real.stat()
    cpu = _cpu_flags()
    spec = importlib.util.find_spec("mlx")
    mlx_at = next(iter(spec.submodule_search_locations)) if spec and spec.submodule_search_locations else ""
    mlx_version = ""
    for d in glob.glob(os.path.join(os.path.dirname(mlx_at), "mlx-*.dist-info")):
        mlx_version = Path(d).name
    return "|".join([str(real), str(stat.st_size), str(int(stat.st_mtime)), mlx_version,
                     hashlib.sha256(cpu.encode()).hexdigest()[:16]])


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _read_verdicts() -> dict[str, str]:
    try:
        data = json.loads((cache_root() / VERDICTS).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_verdicts(verdicts: dict[str, str]) -> None:
    path = cache_root() / VERDICTS
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{VERDICTS}.{os.getpid()}")
        tmp.write_text(json.dumps(verdicts, indent=1, sort_keys=True))
        tmp.replace(path)
    except OSError:
        pass  # a cache that cannot be written only means checking again next time


def _setting(flag: str | None, environ: Mapping[str, str]) -> tuple[str, str]:
    """The setting (--blas FLAG; None: KVLAYOUT_BLAS, else "auto") and how a refusal names it."""
    if flag is not None:
        return flag, f"--blas {flag}"
    value = environ.get(ENV) or "auto"
    return value, f"{ENV}={value}"


def choose(setting: str | None, environ: Mapping[str, str] = os.environ) -> Choice:
    """The BLAS for `setting` (--blas; None: KVLAYOUT_BLAS, else "auto"). ConfigError, one line, for a
    library named explicitly that is not a loadable file or fails its check."""
    setting, named = _setting(setting, environ)
    if setting == "none":
        return Choice(None)
    if setting != "auto":
        path = _named_library(setting, named)
        why = check(path)
        if why is not None:
            raise ConfigError(f"{named}: {why}; use another, or --blas none for MLX's bundled one")
        return Choice(path, preload_env(path, environ))
    passed_over = []
    for path in candidates():
        why = check(path)
        if why is None:
            return Choice(path, preload_env(path, environ), tuple(passed_over))
        passed_over.append(f"BLAS {path} failed its check ({why}); not used")
    return Choice(None, passed_over=tuple(passed_over))


def _named_library(path: str, named: str) -> str:
    """`path` as a real path once it names a file; ConfigError, one line starting with `named`, otherwise."""
    if not Path(path).is_file():
        hint = f" (Debian: apt-get install libopenblas0-pthread gives {DEBIAN_OPENBLAS})"
        what = ("a directory, not a library file" if Path(path).is_dir() else
                "not a library file" if Path(path).exists() else "no such file")
        raise ConfigError(f"{named}: {what}{hint}")
    return str(Path(path).resolve())


def ensure(setting: str | None, argv: list[str], say=lambda line: print(f"kvlayout: {line}", file=sys.stderr)) -> None:
    """Make this process's BLAS the one `setting` chooses (--blas; None: KVLAYOUT_BLAS, else auto):
    re-execute `kvlayout ARGV` with it preloaded when it is not (this call does not return then).
    Libraries passed over are said, one line each. Nothing happens once the choice is made (the
    re-executed process: CHOSEN is set), or when LD_PRELOAD holds a BLAS someone preloaded by hand
    and none is asked for. ConfigError, one line, for a library named that fails its check, or any
    named where there is no BLAS to choose (macOS, a GPU build)."""
    explicit, named = _setting(setting, os.environ)
    if not applies():
        if explicit not in ("auto", "none"):
            where = "macOS builds of MLX use Accelerate" if sys.platform == "darwin" else "this MLX has no CPU BLAS"
            raise ConfigError(f"{named}: {where}; there is no BLAS to preload")
        return
    chosen = os.environ.get(CHOSEN)
    if chosen is not None and (explicit in ("auto", "none") or _same_file(explicit, chosen)):
        return
    if explicit == "auto" and hand_preloaded():
        return
    choice = choose(setting)
    for line in choice.passed_over:
        say(line)
    if choice.path is None:
        os.environ[CHOSEN] = "none"  # nothing to preload: this process goes on as it is
        return
    env = {**os.environ, **choice.env, CHOSEN: choice.path}
    code = "import sys; from kvlayout.cli import main; sys.exit(main())"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-c", code, *argv], env)


def _same_file(a: str, b: str) -> bool:
    try:
        return Path(a).resolve() == Path(b).resolve()
    except OSError:
        return False


def hand_preloaded() -> list[str]:
    """The BLAS-named libraries in LD_PRELOAD (someone chose one already)."""
    return [p for p in os.environ.get("LD_PRELOAD", "").replace(":", " ").split() if "blas" in Path(p).name.lower()]


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
    """The BLAS MLX's matmuls resolve to, in words: a preloaded library wins over the bundled one.

    Read once a BLAS is known (every run's result names it: reading the process's maps costs ~1-3 ms, a
    short run's whole host time): a library mapped stays mapped, and LD_PRELOAD acts only at startup."""
    global _KNOWN
    if _KNOWN is None:
        found = _in_use()
        if not found.startswith(NONE_MAPPED):
            _KNOWN = found
        return found
    return _KNOWN


NONE_MAPPED = "none mapped"  # in_use's answer before a BLAS is mapped (a GPU build, or MLX not loaded yet)
_KNOWN: str | None = None  # in_use's answer once a BLAS is known


def _in_use() -> str:
    if sys.platform == "darwin":
        return "Accelerate (macOS)"
    preloaded = hand_preloaded()
    if preloaded:
        kind = "OpenBLAS" if "openblas" in preloaded[0].lower() else "preloaded"
        return f"{kind} {preloaded[0]} (LD_PRELOAD)"
    blas = [lib for lib in mapped_libraries() if "blas" in Path(lib).name.lower()]
    bundled = [lib for lib in blas if "mlx_cpu.libs" in lib]
    if bundled or (applies() and not blas):
        name = Path(bundled[0]).name if bundled else next(p.name for p in bundled_libraries() if "blas" in p.name)
        return f"reference BLAS bundled with mlx[cpu] ({name})"
    return ", ".join(Path(lib).name for lib in blas) or f"{NONE_MAPPED} (a GPU build, or not loaded yet)"


def fast() -> bool:
    """Whether float32 matmuls on the CPU run on a fast BLAS here: Accelerate, a BLAS preloaded in place
    of the reference one MLX's Linux CPU wheel bundles, or a build without that one. The rule of
    [model] dequantize = "auto": unpacked weights pay only where a fast BLAS multiplies them."""
    return not in_use().startswith("reference BLAS")


def short(full: str | None = None) -> str:
    """`in_use` (or `full`, what it said) in a few words, for a heading: which BLAS, and where it came from."""
    full = in_use() if full is None else full
    if full.startswith("OpenBLAS"):
        return "OpenBLAS (ngsolve-openblas)" if PACKAGE in full else "OpenBLAS (system)"
    if full.startswith("reference BLAS"):
        return "reference BLAS (mlx[cpu])"
    return full.split(" (")[0]
