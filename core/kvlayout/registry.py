"""Finding layouts: the plugin manager, entry-point discovery, resolve and build.

Plugins are found through the entry-point group "kvlayout". Each entry point
is loaded and registered on its own, so one broken plugin is recorded in
`PluginManager.failures` (named with its distribution) and skipped instead of
taking the others down; KVLAYOUT_STRICT=1 raises instead. The host decides
what a plugin's answers mean:

- **Registering** a plugin checks it whole before it counts: a hook kvlayout
  does not have (a misspelled `kvlayout_builder`), an implementation taking an
  argument its hookspec lacks, or a `kvlayout_builders` that raises or returns
  anything but a list of valid `Builder` records refuses the plugin, all of
  it, nothing left registered.
- **Every hook implementation is called through a guard** naming its plugin,
  with pluggy's public API only: beside each plugin the host registers a
  guard object whose implementations (the plugin's own signatures and
  options) call the plugin's, and pluggy calls the guard's in their place
  (`parse_hookimpl_opts` leaves them to it); nothing of pluggy's records is
  rewritten. One that raises becomes a `PluginStepError` (a StepError) on a
  step hook, a `PluginError` otherwise, saying which plugin, which hook and
  what it did. An observer (`kvlayout_step_placed`, `kvlayout_step_aborted`)
  that raises does not stop the others hearing of the step.
- **One referee judges a step hook's outcome**: the host's own wrapper
  around each step hook raises the first observer failure once every
  observer heard of the step, and refuses a `kvlayout_choose_cells` answer
  that is not `count` distinct cells of `free`, naming the plugin that gave
  it. This is the only place the answer is checked: the cell layout trusts
  what the hook returns.
- **A Builder's build and load** are guarded too: raising (anything but a
  KVLayoutError, the layout's own refusal of a bad config) or returning None
  is a `PluginError` naming the layout and its distribution, also recorded in
  `failures`.
- Two distributions claiming the same (backend_id, kind) are an error when
  that key is resolved, never "last one registered wins"; `duplicates` lists
  them for `kvlayout plugins`.
"""

from __future__ import annotations

import collections
import difflib
import functools
import importlib.metadata
import inspect
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs
import numpy as np
import pluggy

from kvlayout import hookspecs
from kvlayout.builder import Builder, layout_key
from kvlayout.checks import env_flag
from kvlayout.errors import (
    ConfigError,
    DuplicateLayout,
    KVLayoutError,
    LayoutNotFound,
    PluginError,
    PluginStepError,
    one_line,
)

ENTRY_POINT_GROUP = "kvlayout"
HOOKS = tuple(sorted(name for name in vars(hookspecs) if name.startswith("kvlayout_")))
STEP_HOOKS = ("kvlayout_choose_cells", "kvlayout_step_placed", "kvlayout_step_aborted")
OBSERVERS = ("kvlayout_step_placed", "kvlayout_step_aborted")


@attrs.frozen
class PluginFailure:
    """A plugin that was skipped, or whose Builder failed, and why.

    `hook` is None when it failed to load or register, else what failed:
    `kvlayout_builders`, `Builder.build` or `Builder.load`. `keys` are the
    layout keys it was seen to claim (empty when its answer never got that far).
    """

    entry_point: str
    distribution: str
    version: str
    error: str
    hook: str | None = None
    keys: tuple[str, ...] = ()

    def describe(self) -> str:
        return f"plugin {self.entry_point!r} from {self.distribution} {self.version}"


@attrs.frozen
class PluginInfo:
    """A registered plugin and the hooks it implements (what `kvlayout plugins` lists)."""

    name: str
    distribution: str | None
    version: str | None
    hooks: tuple[str, ...]


def quote(value: Any, limit: int = 8) -> str:
    """A plugin's answer as a short list or repr, never numpy's truncated array repr."""
    try:
        items = np.asarray(value).tolist() if isinstance(value, (np.ndarray, list, tuple)) else None
    except Exception:
        items = None
    if isinstance(items, list):
        text = repr(items[:limit])
        if len(items) > limit:
            text = f"{text[:-1]}, ... {len(items)} in all]"
    else:
        text = repr(value)
    return text if len(text) <= 120 else text[:119] + "…"


def _check_cells(answer: Any, free: Any, count: int) -> str | None:
    """Why `answer` is not `count` distinct cells of `free` (ascending), or None when it is.

    Once per step: the usual answer is settled in a few microseconds (found in
    `free` by bisection, distinct when their places there rise).
    """
    try:
        cells = np.asarray(answer)
    except Exception:
        cells = None
    if cells is not None and cells.ndim == 1 and cells.size == count and cells.dtype.kind in "iu" and count:
        at = free.searchsorted(cells) if isinstance(free, np.ndarray) else np.searchsorted(free, cells)
        if at.max() < len(free) and (free[at] == cells).all():
            if count == 1 or (at[1:] > at[:-1]).all() or np.unique(at).size == count:
                return None
    if cells is None or cells.ndim != 1:
        why = f"a single {type(answer).__name__}" if cells is None or cells.ndim == 0 else f"a {cells.ndim}-d array"
    elif cells.size != count:
        why = f"{cells.size} cell(s)"
    elif count and (not np.issubdtype(cells.dtype, np.integer)):
        why = f"{cells.dtype} values, not integers"
    else:
        cells = cells.astype(np.int64)
        free = np.asarray(free)
        at = np.minimum(np.searchsorted(free, cells), max(free.size - 1, 0))
        outside = np.flatnonzero(free[at] != cells) if free.size else np.arange(cells.size)
        uniq, counts = np.unique(cells, return_counts=True)
        if outside.size:
            why = f"cell {cells[outside[0]]} is not free"
        elif (counts > 1).any():
            why = f"cell {uniq[counts > 1][0]} more than once"
        else:
            return None
    return f"answered {quote(answer)}: expected {count} distinct cells from the free list ({why})"


HOST = "kvlayout"  # the name the host's referee is registered under; not a plugin anyone installed
GUARD = "{} (guarded)"  # the name of the guard registered beside plugin {}


@attrs.define(eq=False)
class _Call:
    """One step hook call in progress, as the guards report it to the referee."""

    faults: list[PluginError] = attrs.Factory(list)  # observers that raised, in the order they did
    answered: tuple | None = None  # (answer, name, plugin) of the placement that answered, if one did


class _Referee:
    """The host's own wrapper around each step hook: the one place a hook's outcome is judged.

    It opens a `_Call` the guards fill in while pluggy calls every implementation, then, once
    all have run, raises the first observer's failure (each observer heard of the step) or
    refuses a `kvlayout_choose_cells` answer that is not `count` distinct cells of `free`,
    naming the plugin that gave it. A layout calling the hook trusts what comes back.
    """

    def __init__(self, pm: PluginManager, calls: threading.local):
        self.pm, self.calls = pm, calls

    def _open(self) -> Any:
        frames = self.calls.__dict__.setdefault("open", [])
        call = _Call()
        frames.append(call)
        try:
            result = yield
        finally:
            frames.pop()
        if call.faults:
            raise call.faults[0]
        return result, call

    @hookspecs.hookimpl(wrapper=True, tryfirst=True)
    def kvlayout_choose_cells(self, free: Any, count: int) -> Any:
        answer, call = yield from self._open()
        if answer is not None:
            why = _check_cells(answer, free, count)
            if why is not None:
                name, plugin = self._answerer(call, answer)
                hook = "kvlayout_choose_cells"
                raise self.pm.fault(name, plugin, hook, f"{hook} {why}", PluginStepError)
        return answer

    @hookspecs.hookimpl(wrapper=True, tryfirst=True)
    def kvlayout_step_placed(self) -> Any:
        return (yield from self._open())[0]

    @hookspecs.hookimpl(wrapper=True, tryfirst=True)
    def kvlayout_step_aborted(self) -> Any:
        return (yield from self._open())[0]

    def _answerer(self, call: _Call, answer: Any) -> tuple[str, Any]:
        """(name, plugin) of whoever gave the answer that won: the placement that answered, or, when a
        plugin's wrapper replaced its answer, the outermost wrapper inside the referee (the last to return it)."""
        if call.answered is not None and call.answered[0] is answer:
            return call.answered[1], call.answered[2]
        impls = self.pm.hook.kvlayout_choose_cells.get_hookimpls()  # in call order, reversed
        inner = impls[: next(i for i, impl in enumerate(impls) if impl.plugin is self)]
        wrappers = [impl for impl in inner if impl.wrapper or impl.hookwrapper]
        if wrappers:
            return wrappers[-1].plugin_name, wrappers[-1].plugin
        return (call.answered[1], call.answered[2]) if call.answered is not None else (HOST, self)


class _Guarded:
    """The hook implementations of one plugin as pluggy calls them: each through a guard that names
    the plugin (`PluginManager.register` registers one beside each plugin)."""

    def __init__(self, plugin: Any, impls: dict[str, Callable[..., Any]]):
        self.plugin_of_guard = plugin
        for attr, fn in impls.items():
            setattr(self, attr, fn)

    def __repr__(self) -> str:
        return f"<the guard of {self.plugin_of_guard!r}>"


class PluginManager(pluggy.PluginManager):
    """pluggy's manager plus what the host records about each plugin (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__("kvlayout")
        self.add_hookspecs(hookspecs)
        self.failures: list[PluginFailure] = []
        self.provenance: dict[str, tuple[str, str]] = {}  # plugin name -> (distribution, version)
        self._builders: dict[str, list[Builder]] = {}  # plugin name -> its Builders, tagged and guarded
        self._guards: dict[str, _Guarded] = {}  # plugin name -> the guard registered beside it
        self._calls = threading.local()  # per thread: the step hook calls open, innermost last
        # Moves on at every register and unregister: what was asked of the implementations before is stale.
        self.generation = 0
        # (question, hook) -> (generation, the answer then): what `observed` and `sole_implementation` asked pluggy.
        self._hook_answers: dict[tuple[str, str], tuple[int, Any]] = {}
        super().register(_Referee(self, self._calls), name=HOST)

    def kept(self, question: str, hook: str, ask: Callable[[], Any]) -> Any:
        """`ask()`'s answer to `question` about `hook`'s implementations, asked again only once a register or
        an unregister has moved `generation` on (`observed`, `sole_implementation`)."""
        generation = self.generation  # read before pluggy is asked: a change meanwhile makes the answer stale
        known = self._hook_answers.get((question, hook))
        if known is not None and known[0] == generation:
            return known[1]
        value = ask()
        self._hook_answers[question, hook] = (generation, value)
        return value

    # -- naming a plugin

    def short_name(self, name: str, plugin: Any = None) -> str:
        """The entry point's name of a plugin from a distribution, else its registered name
        (an unnamed instance, which pluggy names by its id(), by its class)."""
        if name in self.provenance:  # registered as "distribution:entry point"
            return name.partition(":")[2]
        if name.isdigit() and plugin is not None:
            return type(plugin).__name__
        return name

    def who(self, name: str, plugin: Any = None) -> str:
        """"plugin 'cell' from kvlayout-cell 0.1.0", or "plugin 'name'" for one without a distribution."""
        dist, version = self.provenance.get(name, (None, None))
        where = f" from {dist} {version}" if dist is not None else ""
        return f"plugin {self.short_name(name, plugin)!r}{where}"

    def fault(
        self, name: str, plugin: Any, hook: str | None, reason: str, error: type = PluginError, keys: Iterable[str] = ()
    ) -> PluginError:
        """The PluginError (or `error`) naming plugin `name` and saying `reason`, in one line."""
        reason = one_line(reason)
        dist, version = self.provenance.get(name, (None, None))
        return error(
            f"{self.who(name, plugin)}: {reason}",
            plugin=self.short_name(name, plugin),
            distribution=dist,
            version=version,
            hook=hook,
            reason=reason,
            keys=tuple(keys),
        )

    # -- registering: checked whole, guarded, its Builders collected

    def register(self, plugin: Any, name: str | None = None) -> str | None:
        """Register `plugin`: refused (PluginError, or pluggy's PluginValidationError for an
        implementation taking an argument its hookspec lacks; nothing registered) when it
        implements a hook kvlayout does not have or its `kvlayout_builders` fails.

        pluggy registers the plugin itself (its name, its wrappers) and, beside it, the guard
        through which pluggy calls its implementations of kvlayout's hooks (`parse_hookimpl_opts`
        leaves those to the guard): pluggy's public API only, nothing of its records rewritten."""
        name = super().register(plugin, name)
        self.generation += 1
        if name is None:  # blocked
            return None
        try:
            self._check_known_hooks(plugin, name)
            self._guards[name] = guard = self._guard(plugin, name)
            try:
                super().register(guard, GUARD.format(name))
            except pluggy.PluginValidationError as exc:
                # pluggy checked the guard's copy of a signature: name the plugin
                raise pluggy.PluginValidationError(
                    plugin, str(exc).replace(repr(GUARD.format(name)), repr(name), 1)
                ) from None
            self._builders[name] = self._collect(guard, plugin, name)
        except BaseException:
            self.unregister(plugin=plugin, name=name)
            raise
        finally:
            # Again once the guard is in: an answer another thread asked for in between (`observed`,
            # `sole_implementation`) was kept under the generation above and would outlive the change.
            self.generation += 1
        return name

    def unregister(self, plugin: Any = None, name: str | None = None) -> Any:
        if name is None and plugin is not None:
            name = self.get_name(plugin)
        self.generation += 1
        try:
            self._builders.pop(name, None)
            guard = self._guards.pop(name, None)
            if guard is not None and self.get_plugin(GUARD.format(name)) is guard:
                super().unregister(plugin=guard, name=GUARD.format(name))
            return super().unregister(plugin=plugin, name=name)
        finally:
            self.generation += 1  # as `register`: nothing asked in between outlives it

    def parse_hookimpl_opts(self, plugin: Any, name: str) -> Any:
        """pluggy's own, but a plugin's implementations of kvlayout's hooks (wrappers aside) are
        left to its guard, which pluggy calls instead (`register`)."""
        opts = super().parse_hookimpl_opts(plugin, name)
        if opts is None or isinstance(plugin, (_Guarded, _Referee)) or opts.get("wrapper") or opts.get("hookwrapper"):
            return opts
        return None if (opts.get("specname") or name) in HOOKS else opts

    def _check_known_hooks(self, plugin: Any, name: str) -> None:
        for caller in self.get_hookcallers(plugin) or ():
            if caller.has_spec() or all(i.optionalhook for i in caller.get_hookimpls() if i.plugin is plugin):
                continue
            close = difflib.get_close_matches(caller.name, HOOKS, n=1)
            hint = f"did you mean {close[0]}?" if close else f"kvlayout's hooks are {', '.join(HOOKS)}"
            raise self.fault(name, plugin, None, f"implements {caller.name}, which is not a kvlayout hook; {hint}")

    def _guard(self, plugin: Any, name: str) -> _Guarded:
        """The guard of `plugin`: each of its implementations of kvlayout's hooks (wrappers aside),
        with its own name, signature and options, called through `_guarded`."""
        impls = {}
        for attr in dir(plugin):
            opts = super().parse_hookimpl_opts(plugin, attr)  # pluggy's reading of the plugin, unfiltered
            if opts is None or opts.get("wrapper") or opts.get("hookwrapper"):
                continue
            hook = opts.get("specname") or attr
            # kept under the hook's name (so `subset_hook_caller` finds it), the attribute's for a second
            if hook in HOOKS:
                guarded = self._guarded(getattr(plugin, attr), hook, name, plugin)
                impls[attr if hook in impls else hook] = hookspecs.hookimpl(**{**opts, "specname": hook})(guarded)
        return _Guarded(plugin, impls)

    def _guarded(self, fn: Callable[..., Any], hook: str, name: str, plugin: Any) -> Callable[..., Any]:
        """`fn` called as pluggy calls it, its failure a PluginError (a PluginStepError for a step
        hook) naming the plugin; an observer's is set aside for the referee, a placement's answer
        reported to it."""
        error = PluginStepError if hook in STEP_HOOKS else PluginError
        calls = self._calls

        def guarded(*args: Any) -> Any:
            try:
                answer = fn(*args)
            except (Exception, SystemExit) as exc:  # a plugin calling sys.exit() is a fault like any other
                fault = self.fault(name, plugin, hook, f"{hook} raised {type(exc).__name__}: {exc}", error)
                fault.__cause__ = exc
                frames = getattr(calls, "open", None)
                if hook in OBSERVERS and frames:  # the others hear of the step too; raised after them
                    frames[-1].faults.append(fault)
                    return None
                raise fault from exc
            if answer is not None and hook == "kvlayout_choose_cells":
                frames = getattr(calls, "open", None)
                if frames:
                    frames[-1].answered = (answer, name, plugin)
            return answer

        guarded.__signature__ = inspect.signature(fn)  # type: ignore[attr-defined]  # pluggy passes what fn takes
        guarded.__name__ = getattr(fn, "__name__", hook)
        guarded.__wrapped__ = fn  # type: ignore[attr-defined]
        return guarded

    def _collect(self, guard: _Guarded, plugin: Any, name: str) -> list[Builder]:
        """The plugin's Builders, build/load guarded (`builders` tags them with its distribution);
        PluginError naming what is wrong with its `kvlayout_builders` answer."""
        hook = "kvlayout_builders"
        if not any(caller.name == hook for caller in self.get_hookcallers(guard) or ()):
            return []
        seen: list[Builder] = []

        def refuse(why: str) -> PluginError:
            keys = dict.fromkeys(b.key for b in seen if isinstance(b, Builder) and _name_problem(b) is None)
            return self.fault(name, plugin, hook, f"{hook} {why}", keys=keys)

        # This plugin's implementation alone (with its own wrappers), through its guard: raising is a
        # PluginError already.
        others = [p for p in self.get_plugins() if p is not guard and p is not plugin]
        answers = self.subset_hook_caller(hook, remove_plugins=others)()
        answer = answers[0] if answers else None
        expected = "expected a list of Builder records ([] for none)"
        if answer is None or isinstance(answer, (str, bytes, Builder, Mapping)) or not isinstance(answer, Iterable):
            if isinstance(answer, Builder):
                seen.append(answer)  # its key is known: resolving it says why it is missing
                raise refuse(f"returned one Builder ({answer.key}), not a list: {expected}")
            raise refuse(f"returned {quote(answer)}: {expected}")
        try:
            for item in answer:
                seen.append(item)
        except (Exception, SystemExit) as exc:
            raise refuse(f"raised {type(exc).__name__}: {exc}") from exc
        builders, keys = [], set()
        for b in seen:
            why = _builder_problem(b)
            if why is None and b.key in keys:
                why = f"returned two Builders for {b.key}"
            if why is not None:
                raise refuse(why)
            keys.add(b.key)
            builders.append(self._guard_builder(b, name, plugin))
        return builders

    def _guard_builder(self, b: Builder, name: str, plugin: Any) -> Builder:
        def guard(what: str, fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
            hook = f"Builder.{what}"

            def call(arg: Any) -> Any:
                try:
                    out = fn(arg)
                except KVLayoutError:  # the layout's own refusal (a bad config, a damaged file): already one line
                    raise
                except (Exception, SystemExit) as exc:
                    why = f"layout {b.key}: {what}() raised {type(exc).__name__}: {exc}"
                    raise self._runtime_fault(name, plugin, hook, why, b.key) from exc
                if out is None:
                    why = f"layout {b.key}: {what}() returned None: expected a cache"
                    raise self._runtime_fault(name, plugin, hook, why, b.key)
                return out

            call.__wrapped__ = fn  # type: ignore[attr-defined]
            return call

        return attrs.evolve(b, build=guard("build", b.build), load=None if b.load is None else guard("load", b.load))

    def _runtime_fault(self, name: str, plugin: Any, hook: str, reason: str, key: str) -> PluginError:
        fault = self.fault(name, plugin, hook, reason, keys=[key])
        dist, version = self.provenance.get(name, (name, "?"))
        self.failures.append(PluginFailure(fault.plugin, dist, version, fault.reason, hook, (key,)))
        return fault

    # -- what the host knows

    def builders(self) -> list[Builder]:
        """Every registered plugin's Builders, tagged with its distribution, sorted by key then distribution."""
        found = []
        for name, builders in self._builders.items():
            dist, version = self.provenance.get(name, (name, "?"))
            found += [attrs.evolve(b, distribution=dist, version=version) for b in builders]
        return sorted(found, key=lambda b: (b.key, b.distribution or ""))

    def plugins(self) -> list[PluginInfo]:
        """Every registered plugin with the hooks it implements, by distribution then name."""
        out = []
        for name, plugin in self.list_name_plugin():
            if plugin is None or name == HOST or isinstance(plugin, _Guarded):  # blocked, the host's own, a guard
                continue
            dist, version = self.provenance.get(name, (None, None))
            guard = self._guards.get(name)
            callers = [*(self.get_hookcallers(plugin) or ()), *((guard and self.get_hookcallers(guard)) or ())]
            hooks = tuple(sorted({c.name for c in callers}))
            out.append(PluginInfo(self.short_name(name, plugin), dist, version, hooks))
        return sorted(out, key=lambda p: (p.distribution or "~", p.name))


def _name_problem(b: Builder) -> str | None:
    """Why `b`'s backend_id or kind cannot make a "backend:kind" key, or None."""
    for field in ("backend_id", "kind"):
        value = getattr(b, field)
        if not isinstance(value, str) or not value or ":" in value or value != value.strip():
            return f"returned a Builder with {field}={value!r}: expected a non-empty name without ':' or spaces"
    return None


def _builder_problem(b: Any) -> str | None:
    """Why `b` is not a usable Builder record, or None."""
    if not isinstance(b, Builder):
        return f"returned {quote(b)} among its records: expected Builder records"
    if _name_problem(b) is not None:
        return _name_problem(b)
    if not callable(b.build):
        return f"returned Builder {b.key} whose build is {quote(b.build)}: expected a callable"
    if b.load is not None and not callable(b.load):
        return f"returned Builder {b.key} whose load is {quote(b.load)}: expected a callable or None"
    if not isinstance(b.summary, str):
        return f"returned Builder {b.key} whose summary is {quote(b.summary)}: expected a string"
    return None


def _strict_from_env() -> bool:
    return env_flag("KVLAYOUT_STRICT")  # 1/true/yes/on; 0/false/no/off or unset; else a ConfigError


def observed(pm: Any, hook: str) -> bool:
    """Whether a plugin of `pm` implements `hook` (an observer: `kvlayout_step_placed`, `kvlayout_step_aborted`),
    asked of pluggy, so a plugin registered or unregistered since counts at once (a kvlayout
    PluginManager keeps the answer until its `generation` moves on: a register or an unregister).

    The host's referee wraps every step hook but observes nothing: with no plugin's implementation
    beside it, calling the hook changes nothing, and a layout announcing each step skips the
    call (pluggy's work per call is host time a small model's step cannot hide)."""
    return _asked(pm, "observed", hook, bool)  # any implementation but the referee's


def sole_implementation(pm: Any, hook: str) -> Callable[..., Any] | None:
    """The plugin's own function behind `hook` when exactly one plugin of `pm` implements it and nothing
    but the host's referee wraps it; else None. Kept like `observed`'s answer.

    A layout whose own default is the sole answer may call it directly, without pluggy and the
    referee (~20 us a step): it trusts its own function, tested to the referee's rule. Any other
    plugin's answer goes through the hook, and is judged there."""
    return _asked(pm, "sole", hook, _sole)


def _sole(impls: list) -> Callable[..., Any] | None:
    """The plugin function of the one plain implementation in `impls` (the referee left out), else None."""
    if len(impls) != 1 or impls[0].wrapper or impls[0].hookwrapper:
        return None
    return getattr(impls[0].function, "__wrapped__", impls[0].function)  # the guard's plugin function


def _asked(pm: Any, question: str, hook: str, answer: Callable[[list], Any]) -> Any:
    """`answer(implementations of hook but the referee)`, kept by a kvlayout PluginManager until its generation
    moves on (`PluginManager.kept`); any other pluggy manager is asked every time."""

    def ask() -> Any:
        impls = getattr(pm.hook, hook).get_hookimpls()
        return answer([impl for impl in impls if not isinstance(impl.plugin, _Referee)])

    return pm.kept(question, hook, ask) if isinstance(pm, PluginManager) else ask()


def make_plugin_manager(strict: bool | None = None, entry_points: bool = True) -> PluginManager:
    """A fresh manager with every "kvlayout" entry point loaded; tests use this directly.

    A plugin that fails to load or register is skipped and recorded in
    `failures`; with `strict` (default: KVLAYOUT_STRICT=1) the first one raises PluginError.
    """
    strict = _strict_from_env() if strict is None else strict
    pm = PluginManager()
    if entry_points:
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            _load_entry_point(pm, ep, strict)
    pm.check_pending()  # every plugin was checked as it registered: this never raises
    return pm


def _load_entry_point(pm: PluginManager, ep: importlib.metadata.EntryPoint, strict: bool) -> None:
    dist = ep.dist.name if ep.dist is not None else "unknown"
    version = ep.dist.version if ep.dist is not None else "?"
    name = f"{dist}:{ep.name}"
    if pm.has_plugin(name):  # the same distribution seen twice on sys.path
        return
    pm.provenance[name] = (dist, version)
    try:
        plugin = ep.load()
        pm.register(plugin, name=name)
    except (Exception, SystemExit) as exc:
        del pm.provenance[name]
        if isinstance(exc, PluginError):
            failure = PluginFailure(ep.name, dist, version, exc.reason, exc.hook, exc.keys)
        else:
            failure = PluginFailure(ep.name, dist, version, one_line(f"{type(exc).__name__}: {exc}"))
        if strict:
            raise PluginError(
                f"{failure.describe()} failed to load: {failure.error}",
                plugin=ep.name, distribution=dist, version=version, hook=failure.hook, reason=failure.error,
            ) from exc
        pm.failures.append(failure)


@functools.cache
def plugin_manager() -> PluginManager:
    """The process's plugin manager, entry points loaded once."""
    return make_plugin_manager()


def available(pm: PluginManager | None = None) -> list[Builder]:
    """Every Builder of every loaded plugin, tagged with the distribution that gave it."""
    pm = plugin_manager() if pm is None else pm
    return pm.builders()


def duplicates(builders: list[Builder]) -> dict[str, list[Builder]]:
    """The keys more than one Builder claims, each with its claimants (resolving them fails)."""
    by_key: dict[str, list[Builder]] = collections.defaultdict(list)
    for b in builders:
        by_key[b.key].append(b)
    return {key: bs for key, bs in by_key.items() if len(bs) > 1}


def notices(pm: PluginManager | None = None) -> list[str]:
    """One line per plugin that was skipped: what a command tells its user before it runs."""
    pm = plugin_manager() if pm is None else pm
    return [f"skipped {f.describe()}: {f.error}" for f in pm.failures if f.hook in (None, "kvlayout_builders")]


def _describe(builders: list[Builder]) -> str:
    return ", ".join(f"{b.key} ({b.provider()})" for b in builders) or "none installed"


def resolve(backend_id: str, kind: str, pm: PluginManager | None = None) -> Builder:
    """The one Builder for (backend_id, kind); LayoutNotFound or DuplicateLayout otherwise.

    ConfigError for a backend_id or kind that is not a non-empty string. A key
    no loaded plugin provides says which plugins failed, and why.
    """
    for name, value in (("backend_id", backend_id), ("kind", kind)):
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{name}={value!r}: expected a non-empty string, e.g. resolve('mlx', 'cell')")
    pm = plugin_manager() if pm is None else pm
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
    skipped = [f for f in pm.failures if f.hook in (None, "kvlayout_builders")]
    for f in skipped:
        if key in f.keys:
            raise LayoutNotFound(f"layout {key} is not available: {f.describe()} was skipped: {f.error}")
    hint = ""
    close = difflib.get_close_matches(key, sorted({b.key for b in builders}), n=3, cutoff=0.5)
    if close:
        hint = f"; did you mean {' or '.join(close)}?"
    failed = ""
    if skipped:
        failed = "; skipped: " + "; ".join(f"{f.describe()} ({f.error})" for f in skipped)
    raise LayoutNotFound(f"no layout {key}; available: {_describe(builders)}{hint}{failed}")


def build(backend_id: str, kind: str, config: Any, pm: PluginManager | None = None) -> Any:
    """Resolve (backend_id, kind) and build a cache for `config`."""
    return resolve(backend_id, kind, pm).build(config)
