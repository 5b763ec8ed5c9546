"""Reading a saved state back (the plain JSON of `Engine.state()`, or a run's `run.json`).

Each reader checks one value and returns it, or raises StateError whose
message starts with the value's path in the saved JSON (`running[0].tokens`,
`samples[1][0].rng.state`) and says what was expected, so whoever reports it
can name the field (prefixing its own path: `engine.running[0].tokens`).
Nothing is converted silently: a bool is not an integer, a float not an
integer, an extra key is refused like a missing one. Integers and numbers are
checked by `kvlayout.checks`, quoted as JSON (`from_json`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from kvlayout import checks
from kvlayout.checks import INT64_MAX, kind, shown
from kvlayout.errors import StateError


def at(path: str, key: str | int) -> str:
    """The path of `key` (a member name or a list index) under `path`."""
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def name(value: Any) -> str:
    """A saved name as it reads in a sentence: a short string bare, anything else shown."""
    return value if isinstance(value, str) and len(value) <= 40 else shown(value)


def refuse(path: str, what: str) -> StateError:
    """StateError saying `what` is wrong with the field at `path`."""
    return StateError(f"{path}: {what}")


def bad(path: str, value: Any, expected: str) -> StateError:
    return StateError(f"{path}={shown(value)}: expected {expected}")


def table(value: Any, path: str, keys: Iterable[str]) -> dict:
    """`value`, a JSON object with exactly `keys`."""
    keys = list(keys)
    if not isinstance(value, dict):
        raise refuse(path, f"expected an object ({', '.join(keys)}), got {kind(value)}")
    for k in keys:
        if k not in value:
            raise refuse(at(path, k), "missing")
    extra = sorted(str(k) for k in value if k not in keys)
    if extra:
        raise refuse(at(path, extra[0]), f"not a field of the saved state (expected only {', '.join(keys)})")
    return value


def array(value: Any, path: str, length: int | None = None, minimum: int = 0) -> list:
    """`value`, a JSON array (of exactly `length` items, or at least `minimum`)."""
    if not isinstance(value, list):
        raise refuse(path, f"expected an array, got {kind(value)}")
    if length is not None and len(value) != length:
        raise refuse(path, f"{len(value)} item(s), expected {length}")
    if len(value) < minimum:
        raise refuse(path, f"{len(value)} item(s), expected at least {minimum}")
    return value


def integer(value: Any, path: str, minimum: int | None = None, maximum: int | None = INT64_MAX) -> int:
    """`value`, a JSON integer (never a bool or a float) within [minimum, maximum]."""
    return checks.int_scalar(path, value, StateError, minimum, maximum, numpy=False, from_json=True)


def integers(value: Any, path: str, minimum: int, maximum: int) -> list[int]:
    """`value`, a JSON array of integers within [minimum, maximum]."""
    return [integer(x, at(path, i), minimum, maximum) for i, x in enumerate(array(value, path))]


def number(value: Any, path: str, minimum: float = 0.0) -> float:
    """`value`, a finite JSON number >= minimum (an integer is a number)."""
    return checks.finite_number(path, value, StateError, minimum, from_json=True)


def text(value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise bad(path, value, "a string")
    return value


def flag(value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        raise bad(path, value, "true or false")
    return value


def choice(value: Any, path: str, options: Sequence[Any]) -> Any:
    """`value`, one of `options` (compared by type too: 1 is not True)."""
    if not any(type(value) is type(o) and value == o for o in options):
        raise bad(path, value, f"one of {', '.join(shown(o) for o in options)}")
    return value
