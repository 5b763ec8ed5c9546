"""Builder: the record a layout plugin hands the registry."""

from __future__ import annotations

from typing import Any, Callable

import attrs


@attrs.frozen
class Builder:
    """How to build one layout; `build(config)` returns a cache.

    A plugin fills the first four fields; the registry fills `distribution`
    and `version` with the package that provided the record.
    """

    backend_id: str
    kind: str
    build: Callable[[Any], Any] = attrs.field(repr=False)
    summary: str = ""
    distribution: str | None = None
    version: str | None = None

    @property
    def key(self) -> str:
        return f"{self.backend_id}:{self.kind}"

    def provider(self) -> str:
        if self.distribution is None:
            return "unknown distribution"
        return f"{self.distribution} {self.version}"
