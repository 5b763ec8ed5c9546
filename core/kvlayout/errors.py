"""The project's exceptions: one root so a runtime can catch everything we raise."""


class KVLayoutError(Exception):
    """Root of every error kvlayout raises."""


class ConfigError(KVLayoutError, ValueError):
    """A configuration value is invalid; the message names the field and the value."""


class LayoutNotFound(KVLayoutError, LookupError):
    """No installed plugin provides the requested (backend_id, kind)."""


class DuplicateLayout(KVLayoutError):
    """Two distributions claim the same (backend_id, kind); never resolved silently."""


class StepError(KVLayoutError, RuntimeError):
    """A step breaks the cache protocol (undeclared, miscounted, served twice...)."""


class PluginError(KVLayoutError):
    """A plugin broke its contract: it failed to load, a hook of it raised or answered what its
    hookspec forbids, or its Builder's build/load raised or returned None.

    The message names the plugin (entry point and distribution) and the hook;
    so do the attributes `plugin`, `distribution`, `version` and `hook`
    (None where not known). `reason` is the message without the plugin's name.
    """

    def __init__(
        self,
        message: str,
        *,
        plugin: str | None = None,
        distribution: str | None = None,
        version: str | None = None,
        hook: str | None = None,
        reason: str | None = None,
        keys: tuple[str, ...] = (),
    ):
        super().__init__(message)
        self.plugin, self.distribution, self.version, self.hook = plugin, distribution, version, hook
        self.reason = message if reason is None else reason
        self.keys = keys  # the layout keys the plugin was seen to claim, when known


class PluginStepError(PluginError, StepError):
    """A plugin's hook failed during a cell step (`kvlayout_choose_cells`, `kvlayout_step_placed`,
    `kvlayout_step_aborted`). A StepError like the layout's own refusals, but a plugin's fault:
    the runner does not retry it as a transient forward failure."""


class CapacityError(KVLayoutError):
    """An operation that cannot report pressure as a return value ran out of cells."""


class SequenceError(KVLayoutError, ValueError):
    """A sequence id is out of range or not live."""


class StateError(KVLayoutError):
    """A state file cannot be where asked (a path that is no file path, a directory, a
    directory that does not exist, a write the OS refused: nothing was written), or a
    saved one is truncated, corrupted, of another format version, or does not match the
    installed layout or the expected config: nothing was loaded."""


class RunEnded(KVLayoutError):
    """A failure no retry can mend, which ends the run where it happened: the engines abort the
    step and let it through (a tensor-parallel rank that lost its peers, `kvlayout.distributed`)."""
