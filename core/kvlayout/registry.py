"""Finding layouts: the plugin manager, entry-point discovery, resolve and build.

Plugins are found through the entry-point group "kvlayout". Each entry point
is loaded on its own so one broken plugin is named on stderr and skipped
instead of taking the others down (KVLAYOUT_STRICT=1 raises instead). Two
distributions claiming the same (backend_id, kind) are an error when that key
is resolved, never "last one registered wins".
"""

from __future__ import annotations

import difflib
import functools
import importlib.metadata
import sys
from typing import Any

import attrs
import pluggy

from kvlayout import hookspecs
from kvlayout.builder import Builder, layout_key
from kvlayout.checks import env_flag
from kvlayout.errors import ConfigError, DuplicateLayout, KVLayoutError, LayoutNotFound

ENTRY_POINT_GROUP = "kvlayout"


@attrs.frozen
class LoadFailure:
    """A plugin that could not be loaded, and why."""

    entry_point: str
    distribution: str
    version: str
    error: str


class PluginManager(pluggy.PluginManager):
    """pluggy's manager plus what the host records about each plugin."""

    def __init__(self) -> None:
        super().__init__("kvlayout")
        self.add_hookspecs(hookspecs)
        self.failures: list[LoadFailure] = []
        self.provenance: dict[str, tuple[str, str]] = {}  # plugin name -> (distribution, version)


def _strict_from_env() -> bool:
    return env_flag("KVLAYOUT_STRICT")  # 1/true/yes/on; 0/false/no/off or unset; else a ConfigError


def make_plugin_manager(strict: bool | None = None, entry_points: bool = True) -> PluginManager:
    """A fresh manager with every "kvlayout" entry point loaded; tests use this directly."""
    strict = _strict_from_env() if strict is None else strict
    pm = PluginManager()
    if entry_points:
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            _load_entry_point(pm, ep, strict)
    pm.check_pending()
    return pm


def _load_entry_point(pm: PluginManager, ep: importlib.metadata.EntryPoint, strict: bool) -> None:
    dist = ep.dist.name if ep.dist is not None else "unknown"
    version = ep.dist.version if ep.dist is not None else "?"
    name = f"{dist}:{ep.name}"
    if pm.has_plugin(name):  # the same distribution seen twice on sys.path
        return
    try:
        plugin = ep.load()
        pm.register(plugin, name=name)
    except Exception as exc:
        if strict:
            raise KVLayoutError(
                f"plugin {ep.name!r} from {dist} {version} failed to load: {type(exc).__name__}: {exc}"
            ) from exc
        failure = LoadFailure(ep.name, dist, version, f"{type(exc).__name__}: {exc}")
        pm.failures.append(failure)
        print(
            f"kvlayout: skipped plugin {ep.name!r} from {dist} {version}: {failure.error}",
            file=sys.stderr,
        )
        return
    pm.provenance[name] = (dist, version)


@functools.cache
def plugin_manager() -> PluginManager:
    """The process's plugin manager, entry points loaded once."""
    return make_plugin_manager()


def available(pm: PluginManager | None = None) -> list[Builder]:
    """Every Builder of every loaded plugin, tagged with the distribution that gave it."""
    pm = plugin_manager() if pm is None else pm
    builders: list[Builder] = []
    for impl in pm.hook.kvlayout_builders.get_hookimpls():
        dist, version = pm.provenance.get(impl.plugin_name, (impl.plugin_name, "?"))
        for builder in impl.function() or ():
            if not isinstance(builder, Builder):
                raise KVLayoutError(
                    f"plugin {impl.plugin_name!r} returned {builder!r} from kvlayout_builders: "
                    "expected Builder records"
                )
            builders.append(attrs.evolve(builder, distribution=dist, version=version))
    return sorted(builders, key=lambda b: (b.key, b.distribution or ""))


def _describe(builders: list[Builder]) -> str:
    return ", ".join(f"{b.key} ({b.provider()})" for b in builders) or "none installed"


def resolve(backend_id: str, kind: str, pm: PluginManager | None = None) -> Builder:
    """The one Builder for (backend_id, kind); LayoutNotFound or DuplicateLayout otherwise.

    ConfigError for a backend_id or kind that is not a non-empty string.
    """
    for name, value in (("backend_id", backend_id), ("kind", kind)):
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{name}={value!r}: expected a non-empty string, e.g. resolve('mlx', 'cell')")
    builders = available(pm)
    key = layout_key(backend_id, kind)
    matches = [b for b in builders if b.key == key]
    if len(matches) > 1:
        raise DuplicateLayout(
            f"layout {key} is provided by more than one distribution: "
            f"{', '.join(b.provider() for b in matches)}; uninstall all but one"
        )
    if matches:
        return matches[0]
    hint = ""
    close = difflib.get_close_matches(key, sorted({b.key for b in builders}), n=3, cutoff=0.5)
    if close:
        hint = f"; did you mean {' or '.join(close)}?"
    raise LayoutNotFound(f"no layout {key}; available: {_describe(builders)}{hint}")


def build(backend_id: str, kind: str, config: Any, pm: PluginManager | None = None) -> Any:
    """Resolve (backend_id, kind) and build a cache for `config`."""
    return resolve(backend_id, kind, pm).build(config)
