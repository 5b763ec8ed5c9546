"""The faces a cache may implement, and the records that cross them.

A runtime programs against these Protocols, never against a layout class: it
asks a cache for a face (`as_control()`, `as_batch_control()`,
`as_cell_stepper()`, `as_cell_view()`) and gets a face object or None. A face object exposes
exactly the members its Protocol names (`face_of`), so a runtime cannot lean
on anything else a layout happens to have. What `update_and_fetch` (the
KVCache face) returns, and `attend()` consumes, lives in `kvlayout.spec`.
"""

from __future__ import annotations

import functools
import inspect
import operator
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Generic, Protocol, runtime_checkable

import attrs
import numpy as np

if TYPE_CHECKING:
    from kvlayout.spec import AttendSpec


@attrs.frozen(eq=False)
class CellStep:
    """One placed step of the cell layout, shared by every layer with the same window.

    `cells` (int32 `[length]`) are the cells the step's tokens go to; `mask`
    (bool `[length, read_len]`, True = attend) says which cells of
    `[0, read_len)` each token sees.

    `mask` may be given as the array or as a function of no argument that
    computes it: a layout that attends by groups never needs the dense mask,
    so it is built on first access only (then kept: every access returns
    the same array).
    """

    length: int
    read_len: int
    cells: np.ndarray
    _mask: Any = attrs.field(alias="mask", repr=False)

    @property
    def mask(self) -> np.ndarray:
        mask = self._mask
        if callable(mask):
            mask = mask()
            object.__setattr__(self, "_mask", mask)  # computed once; the record stays frozen otherwise
        return mask


@runtime_checkable
class CacheControl(Protocol):
    """What any runtime may ask of a cache between forwards.

    Lack of room is an answer (False/None), never an exception; a refused
    call changes nothing.
    """

    @property
    def capacity(self) -> int:
        """The most tokens (seq) or cells (cell) the cache can ever hold."""
        ...

    def can_extend(self, n: int = 1) -> bool:
        """Whether `n` more tokens fit now."""
        ...

    def clear(self) -> None:
        """Forget everything held; the cache is as built. Always allowed, in the middle of a
        forward too (the step in progress is dropped with the rest)."""
        ...


@runtime_checkable
class SequenceControl(CacheControl, Protocol):
    """One sequence: a single logical length for the whole model."""

    @property
    def length(self) -> int:
        """Tokens held: the next step's first position."""
        ...

    @property
    def max_step(self) -> int:
        """The most tokens one step (one forward) may carry through this cache; a runtime chunks
        longer prompts to it (a ring layer, say, takes at most its window per step)."""
        ...

    def rewind(self, new_len: int) -> bool:
        """Shorten to `new_len` tokens; False (nothing changed) where the layout cannot (a ring
        that already reused the slots below its floor). `rewind(0)` always succeeds. In the
        middle of a forward, StepError (nothing changed) for a `new_len` that would keep part of
        the step some layers have not written yet."""
        ...


@runtime_checkable
class BatchControl(CacheControl, Protocol):
    """Many sequences over one pool of cells, each under an integer id.

    One forward is one step: `declare_step` names each token's sequence
    first (the admission gate), then the layers place and read the step.
    In between its first layer and its last, every verb but `clear` (which
    drops the step with the rest) is refused with StepError, nothing
    changed: it would leave cells some layers never wrote.

    Ids: the queries (`seq_len`, `next_pos`) answer for any id in
    `[0, max_seqs)`, 0 for one not live: it holds nothing, as a live empty
    id does (an id dies when a `seq_rm` leaves it owning nothing, so a
    runtime asking after one it just trimmed gets a count, not an error).
    The verbs that act on a sequence (`declare_step`, `seq_clone`'s `src`,
    `seq_rm`) need it live: SequenceError naming the id, nothing changed.
    An id out of range is a SequenceError everywhere.
    """

    @property
    def free_cells(self) -> int:
        """Cells no sequence owns."""
        ...

    @property
    def used_end(self) -> int:
        """One past the last occupied cell (0 when none is): what a step reads up to."""
        ...

    @property
    def max_seqs(self) -> int:
        """How many ids may be live at once (ids are `[0, max_seqs)`)."""
        ...

    def declare_step(self, seq_ids: Sequence[int]) -> bool:
        """Name the sequence of each token of the next forward; False (nothing changed) when the
        free cells are too few. Ids must be live."""
        ...

    def seq_new(self) -> int | None:
        """A new live, empty id (the lowest free); None when every id is live."""
        ...

    def seq_clone(self, src: int, upto: int | None = None) -> int | None:
        """A new id sharing `src`'s cells with position < `upto` (all when None), copying none;
        None when every id is live."""
        ...

    def seq_rm(self, seq_id: int, p0: int = 0, p1: int | None = None) -> None:
        """Drop `seq_id`'s positions `[p0, p1)` (p1 None: to its end); cells nobody owns any more
        are freed, and an id left owning nothing is released."""
        ...

    def seq_len(self, seq_id: int) -> int:
        """Cells `seq_id` owns: 0 for an id not live (see the class); SequenceError for an id out of
        range."""
        ...

    def next_pos(self, seq_id: int) -> int:
        """One past the newest position `seq_id` holds: 0 when it holds none, an id not live
        included (see the class); SequenceError for an id out of range."""
        ...

    def seq_floor(self, seq_id: int) -> int:
        """The least position but 0 at which live `seq_id` can be continued: a
        `seq_clone(seq_id, upto)` or a `seq_rm(seq_id, p0)` taking its end off that continues it below
        it is refused (SequenceError), since a sliding-window layer no longer holds the window before
        it. It continues one past its newest position below `upto` / `p0` (below a hole, less than
        them). 0 when any position will do (a layout or model without windows)."""
        ...

    def seq_pin(self, seq_id: int, pinned: bool = True) -> None:
        """Keep (True) or stop keeping (False) every position live `seq_id` holds, sliding-window
        layers included, which otherwise keep only what its next query can read: a prompt a prefix
        cache will keep, so later sequences can be cloned from it at any position. A clone of a
        pinned sequence holds all of it below `upto`. A no-op for a layout without windows."""
        ...

    def cells_by_window(self) -> dict[int, int]:
        """Cells in use per layer group, by window (0: the flat layers; one entry for a layout
        holding every layer's K/V in the same cells): what each group's layers hold now."""
        ...


@runtime_checkable
class CellStepper(Protocol):
    """The layer side of a declared cell step: where its tokens go and what each sees."""

    def place_step(self, layer: int, positions: Sequence[int]) -> CellStep:
        """The declared step for `layer` at `positions`: placed by the first layer served, the same
        cells for every later one (see `CellStep`)."""
        ...


@runtime_checkable
class CellView(Protocol):
    """Read-only: which sequences own each cell. For pictures, stats and traces; not on the
    step path (it copies what it reports)."""

    @property
    def capacity(self) -> int: ...

    @property
    def max_seqs(self) -> int: ...

    def cell_owners(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(cells int64 [n], positions int [n], owners bool [n, max_seqs]) of every occupied
        cell, ascending; `owners[i, s]` says sequence id `s` owns `cells[i]`. Copies."""
        ...


@runtime_checkable
class KVCache(Protocol):
    """The op face every MLX layout implements; `k`, `v` are `[1, H_kv, T, D]`."""

    def update_and_fetch(self, layer: int, positions: Sequence[int], k: Any, v: Any) -> AttendSpec: ...


@runtime_checkable
class StepAbort(Protocol):
    """Atomic steps: `abort_step()` undoes the open step of a forward that failed part way.

    True: the state is what it was before the step's first layer (see each
    layout for what an overwrite below the length keeps); False: no step was
    open, nothing changed. Both shipped layouts implement it.
    """

    def abort_step(self) -> bool: ...


@runtime_checkable
class Persistent(Protocol):
    """Save and restore: `save(path)` writes the cache atomically; `kvlayout.load(path)` reads it back."""

    def save(self, path: Any) -> Any: ...


class FacesBase:
    """Face recovery without isinstance chains: a layout overrides the faces it has."""

    def as_control(self) -> SequenceControl | None:
        return None

    def as_batch_control(self) -> BatchControl | None:
        return None

    def as_cell_stepper(self) -> CellStepper | None:
        return None

    def as_cell_view(self) -> CellView | None:
        return None


def contract(protocol: type) -> tuple[str, ...]:
    """The public members a face Protocol names, its Protocol bases' included, sorted."""
    names: set[str] = set()
    for klass in protocol.__mro__:
        if klass not in (object, Protocol, Generic):
            names.update(name for name in vars(klass) if not name.startswith("_"))
    return tuple(sorted(names))


class Face:
    """A face object: exactly one contract's members of the parts behind it (see `face_of`)."""

    __slots__ = ("_impl",)  # the parts, for repr


def face_of(protocol: type, impl: Any, *parts: Any) -> Any:
    """A face object of `protocol` over `impl`: what a layout returns from `as_*()`.

    `face_of(SequenceControl, book)` forwards `rewind`, `length`, ... to the
    book and has nothing else, so a runtime cannot reach past the contract
    (to a layout's `restore`, say). A layout whose verbs live in more than
    one part names them all: each member comes from the first of `impl,
    *parts` that has it, so the cell layout's BatchControl is
    `face_of(BatchControl, stepper, table)`, the stepper's verbs that change
    the table (each ends the open step first) and the table's counts, read
    straight, every verb implemented once. Methods are the parts' own bound
    methods, looked up once (a call costs no extra frame); properties are
    read through on each access. Every member is a real attribute of the
    face's class, so `isinstance(face, protocol)` holds on every Python
    version. TypeError names what the parts lack.
    """
    return _face_class(protocol)(impl, *parts)


@functools.cache
def _face_class(protocol: type) -> type:
    members = contract(protocol)
    properties = tuple(n for n in members if isinstance(inspect.getattr_static(protocol, n), property))
    methods = tuple(n for n in members if n not in properties)
    sources = tuple(f"_of_{n}" for n in properties)  # the part each property is read from

    def __init__(self, *parts: Any) -> None:
        owner = {n: next((p for p in parts if hasattr(p, n)), None) for n in members}
        missing = [n for n in members if owner[n] is None]
        if missing:
            names = " + ".join(type(p).__name__ for p in parts)
            raise TypeError(f"{names} lacks {', '.join(missing)} of the {protocol.__name__} face")
        self._impl = parts
        for name in methods:
            setattr(self, name, getattr(owner[name], name))
        for name, source in zip(properties, sources):
            setattr(self, source, owner[name])

    def __repr__(self) -> str:
        return f"<{protocol.__name__} face of {' + '.join(map(repr, self._impl))}>"

    namespace: dict[str, Any] = {
        "__slots__": methods + sources,
        "__init__": __init__,
        "__repr__": __repr__,
        "__doc__": f"The {protocol.__name__} face: {', '.join(members)}, forwarded (see kvlayout.faces.face_of).",
    }
    for name, source in zip(properties, sources):
        doc = inspect.getattr_static(protocol, name).__doc__
        namespace[name] = property(operator.attrgetter(f"{source}.{name}"), doc=doc)
    return type(f"{protocol.__name__}Face", (Face,), namespace)
