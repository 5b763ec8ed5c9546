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


class CapacityError(KVLayoutError):
    """An operation that cannot report pressure as a return value ran out of cells."""


class SequenceError(KVLayoutError, ValueError):
    """A sequence id is out of range or not live."""


class StateError(KVLayoutError):
    """A state file cannot be where asked (a path that is no file path, a directory, a
    directory that does not exist, a write the OS refused: nothing was written), or a
    saved one is truncated, corrupted, of another format version, or does not match the
    installed layout or the expected config: nothing was loaded."""
