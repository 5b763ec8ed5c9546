"""Where fetched and converted models live, and how a model directory appears whole.

The root is `$KVLAYOUT_CACHE`, else `$XDG_CACHE_HOME/kvlayout`, else
`~/.cache/kvlayout`. A directory is built under a temporary name beside its
final one and renamed into place, so an interrupted build never leaves a
directory that looks done: in the cache (`publish_dir`) and at a path the
user names (`write_model_dir`, `kvlayout init-model DIR`).
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from kvlayout.errors import ConfigError, one_line, os_reason


def cache_root() -> Path:
    """kvlayout's cache directory (not created)."""
    if os.environ.get("KVLAYOUT_CACHE"):
        return Path(os.environ["KVLAYOUT_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "kvlayout"


def publish_dir(final: Path, build: Callable[[Path], object]) -> Path:
    """Run `build(tmp)` on an empty directory beside `final`, then move it to `final`.

    An existing `final` is replaced. If `build` raises, `final` is as it was and
    the temporary directory is gone. An OSError names `final` (and the paths
    under it) where it named the temporary directory, which its caller never saw.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = None
    try:
        tmp = _fresh_dir(final.parent, f".{final.name}.", ".tmp")
        build(tmp)
        if final.exists():
            # rename() cannot replace a non-empty directory: move the old one aside first.
            old = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".old", dir=final.parent))
            final.rename(old / final.name)
            shutil.rmtree(old, ignore_errors=True)
        tmp.rename(final)
    except OSError as exc:
        _name_final(exc, final)
        raise
    finally:
        if tmp is not None and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _name_final(exc: OSError, final: Path) -> None:
    """Put `final` in `exc` where it names a temporary directory beside it (`.NAME.<random>.tmp` or `.old`)."""
    temporary = re.compile("^" + re.escape(str(final.parent / f".{final.name}.")) + r"[^/]*\.(?:tmp|old)(?=/|$)")
    for attr in ("filename", "filename2"):
        name = getattr(exc, attr, None)
        if isinstance(name, str):
            setattr(exc, attr, temporary.sub(lambda _: str(final), name))


def _fresh_dir(parent: Path, prefix: str, suffix: str) -> Path:
    """A new empty directory under `parent` with a random name, made by mkdir: with the mode the
    umask gives any directory, where tempfile.mkdtemp's 0700 would hide a published model from others."""
    while True:
        path = parent / f"{prefix}{secrets.token_hex(4)}{suffix}"
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue


def check_model_dir(dest: Path, force: bool = False) -> None:
    """Refuse `dest` as the user's new model directory: a file, or a non-empty directory unless `force`.

    Writing into a used directory would mix two models (a stale
    chat_template.jinja left there changes every prompt), so it is replaced
    whole or not at all.
    """
    dest = Path(dest)
    if dest.exists() and not dest.is_dir():
        raise ConfigError(f"{dest} is a file, not a directory; name a new or empty directory for the model")
    if not force and dest.is_dir() and any(dest.iterdir()):
        raise ConfigError(f"{dest} is not empty; name a new or empty directory, or replace it whole with --force")


def write_model_dir(dest: Path, build: Callable[[Path], object], force: bool = False) -> Path:
    """`build(tmp)` the model directory, then put it at `dest` whole (`publish_dir`).

    Refused first, nothing changed, as `check_model_dir` says; `force`
    replaces a non-empty directory. A failed build leaves `dest` as it was;
    an OSError (a parent that is a file or not writable) is a ConfigError.
    """
    dest = Path(dest)
    check_model_dir(dest, force)
    try:
        return publish_dir(dest, build)
    except OSError as exc:
        raise ConfigError(f"cannot write {dest}: {_why(exc, dest)}") from None


def _why(exc: OSError, dest: Path) -> str:
    """The error's reason. One naming only `dest` came from making a directory beside it (`publish_dir`
    names `dest` for its temporary one): say so, where "No such file or directory: DEST" would puzzle."""
    if exc.filename == str(dest) and exc.filename2 is None:
        return f"cannot make a directory in {dest.absolute().parent} ({os_reason(exc)})"
    return one_line(exc)
