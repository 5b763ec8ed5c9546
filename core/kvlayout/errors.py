"""The project's exceptions, every one of them, and how an exception is said in one line.

One root, KVLayoutError, so a runtime can catch everything we raise. The two
outside it are Ctrl-C's: `Interrupted` (and the runner's `RunInterrupted`)
is a KeyboardInterrupt, so whatever stops on Ctrl-C stops on it too.

An error a client of `kvlayout serve` can cause carries the HTTP answer it
gets: `status` (None on every other error, which the server answers 500) and
the fields of OpenAI's error object beside the message (`kind`, `param`,
`code`). The server maps any KVLayoutError with a status to its answer;
there is no second tree of HTTP errors.
"""

from __future__ import annotations


class KVLayoutError(Exception):
    """Root of every error kvlayout raises.

    `status`: the HTTP status `kvlayout serve` answers it with (None: no
    client's doing, a 500); `kind`, `param`, `code`: OpenAI's error fields.
    """

    status: int | None = None
    kind: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None


class ConfigError(KVLayoutError, ValueError):
    """A configuration value is invalid; the message names the field and the value."""


class LayoutNotFound(KVLayoutError, LookupError):
    """No installed plugin provides the requested (backend_id, kind)."""


class DuplicateLayout(KVLayoutError):
    """Two distributions claim the same (backend_id, kind); never resolved silently."""


class StepError(KVLayoutError, RuntimeError):
    """A step breaks the cache protocol (undeclared, miscounted, served twice...)."""


class ShapeError(KVLayoutError, ValueError):
    """Arrays handed to a step disagree with each other (tokens and positions of different
    lengths, pages that do not tile the pool's slots); the message names both."""


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


class SaveFailed(StateError):
    """A run's state was not saved (`kvlayout run --save-state`); the message says why and what
    the directory holds now. `interrupted`: a second Ctrl-C abandoned it."""

    def __init__(self, message: str, interrupted: bool = False):
        super().__init__(message)
        self.interrupted = interrupted


class InstallError(KVLayoutError):
    """A file kvlayout ships is missing or not what it shipped: the installation is damaged
    (reinstalling mends it). The message names the file."""


class MissingExtra(KVLayoutError):
    """A package of the `bench` extra is not installed; the message says who needs it and how to install it."""


# -- a run that cannot go on


class RunEnded(KVLayoutError):
    """A failure no retry can mend, which ends the run where it happened: the engines abort the
    step and let it through (a tensor-parallel rank that lost its peers, `kvlayout.distributed`)."""


class DistributedError(RunEnded):
    """The ranks disagree (inputs, model, tables) or one of them is gone; the message names the rank.
    A RunEnded: the engines let it through, so it ends the run on this rank, and, at their next
    collective, on the others."""


class LeaderRefused(KVLayoutError):
    """Rank 0 refused the run (its message was said there); the other ranks stop with it."""


class ForwardFailed(KVLayoutError):
    """A forward raised and its step was aborted (`engines.recovery`); `cause` is what it raised.

    `retry`: whether the failure may be transient (False for a plugin's fault).
    The message is the cause's: a PluginError's own (it names the plugin and
    the hook), else prefixed with the exception's type.
    """

    def __init__(self, cause: BaseException):
        plugin = isinstance(cause, PluginError)
        super().__init__(str(cause) if plugin else f"{type(cause).__name__}: {cause}")
        self.cause = cause
        self.retry = not plugin


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during a forward; the step was aborted, so the run's state is whole."""


class RunInterrupted(Interrupted):
    """Ctrl-C inside a forward of `kvlayout run`; the step was aborted. `save_failed`: None when the
    state was saved (or none was asked for), else the SaveFailed saying why not."""

    def __init__(self, save_failed: Exception | None = None):
        super().__init__()
        self.save_failed = save_failed


# -- what a client of `kvlayout serve` is answered


class BadRequest(KVLayoutError):
    """A request refused: `status` (400, 404, 413; 500 when its generation failed) and OpenAI's
    error fields, `param` naming the field at fault. `message` is the message."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.code, self.kind = message, param, status, code, kind


class QueueFull(KVLayoutError):
    """The server's queue is full, or the server is going down (`why`): 429, the client may retry."""

    status = 429
    kind = "rate_limit_error"
    code = "rate_limit_exceeded"

    def __init__(self, why: str):
        super().__init__(f"the server is busy: {why}; retry later")


# -- an exception, said in one line


def one_line(reason: BaseException | str) -> str:
    """`reason` (an exception, or its text) as one line for a user: every run of whitespace,
    newlines included, as one space."""
    return " ".join(str(reason).split())


def os_reason(exc: OSError) -> str:
    """What the OS said ("Permission denied"), in one line, for a message that names the file
    itself: an OSError's `strerror`, without the errno and path its str() adds; its one line
    when it has none."""
    return exc.strerror or one_line(exc)
