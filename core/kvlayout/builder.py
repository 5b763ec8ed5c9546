"""Builder: the record a layout plugin hands the registry, and its "backend:kind" key.

The key names a layout everywhere a string must (`--layout mlx:seq`, a saved
file's header, error messages); `layout_key` writes it and `split_layout_key`
reads it, and nothing else does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from kvlayout.errors import ConfigError


def layout_key(backend_id: str, kind: str) -> str:
    """The key naming a layout: "mlx:cell"."""
    return f"{backend_id}:{kind}"


def split_layout_key(key: Any, what: str = "layout") -> tuple[str, str]:
    """(backend_id, kind) of a "backend:kind" key; ConfigError naming `what` for anything else."""
    backend, sep, kind = key.partition(":") if isinstance(key, str) else ("", "", "")
    if not sep or not backend or not kind:
        raise ConfigError(f"{what} {key!r}: expected backend:kind, e.g. mlx:seq")
    return backend, kind


@attrs.frozen
class Builder:
    """How to build one layout; `build(config)` returns a cache.

    A plugin fills the first four fields, and `load` if its caches can be
    saved; the registry fills `distribution` and `version` with the package
    that provided the record.

    `load(state_file)` rebuilds a cache from a `kvlayout.persist.StateFile`
    its `cache.save(path)` wrote; `kvlayout.load(path)` finds the Builder by
    the file's layout key and calls it. It is a field here, not a hook, so a
    saved file reaches exactly the layout that resolves its key (with the
    registry's clash detection), never whichever plugin answers first.
    """

    backend_id: str
    kind: str
    build: Callable[[Any], Any] = attrs.field(repr=False)
    summary: str = ""
    distribution: str | None = None
    version: str | None = None
    load: Callable[[Any], Any] | None = attrs.field(default=None, repr=False)

    @property
    def key(self) -> str:
        return layout_key(self.backend_id, self.kind)

    def provider(self) -> str:
        if self.distribution is None:
            return "unknown distribution"
        return f"{self.distribution} {self.version}"
