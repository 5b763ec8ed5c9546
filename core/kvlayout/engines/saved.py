"""Reading a saved state back (the plain JSON of `Engine.state()`, or a run's `run.json`).

Each reader checks one value and returns it, or raises StateError whose
message starts with the value's path in the saved JSON (`running[0].tokens`,
`samples[1][0].rng.state`) and says what was expected, so whoever reports it
can name the field (prefixing its own path: `engine.running[0].tokens`).
Nothing is converted silently: a bool is not an integer, a float not an
integer, an extra key is refused like a missing one.
"""

from __future__ import annotations

import json
import math
from typing import Any, Iterable, Sequence

from kvlayout.errors import StateError


def at(path: str, key: str | int) -> str:
    """The path of `key` (a member name or a list index) under `path`."""
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def shown(value: Any, width: int = 60) -> str:
    """`value` as JSON writes it, cut to `width` characters (a damaged field may be huge)."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= width else text[: width - 1] + "…"


def bound(n: int) -> str:
    """An integer bound as a reader takes it in: a large power of two as one."""
    return f"2**{(n + 1).bit_length() - 1} - 1" if n > 2**32 and (n + 1) & n == 0 else str(n)


def name(value: Any) -> str:
    """A saved name as it reads in a sentence: a short string bare, anything else shown."""
    return value if isinstance(value, str) and len(value) <= 40 else shown(value)


def kind(value: Any) -> str:
    return {type(None): "null", dict: "an object", list: "an array", str: "a string", bool: "a bool",
            int: "an integer", float: "a number"}.get(type(value), type(value).__name__)


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


INT64_MAX = 2**63 - 1  # a count, an id, a position: nothing a run saves is larger


def integer(value: Any, path: str, minimum: int | None = None, maximum: int | None = INT64_MAX) -> int:
    """`value`, a JSON integer (never a bool or a float) within [minimum, maximum]."""
    if type(value) is int and (minimum is None or value >= minimum) and (maximum is None or value <= maximum):
        return value
    if maximum == INT64_MAX:
        expected = "an integer" + (f" >= {minimum}" if minimum is not None else "") + " that fits in 64 bits"
    elif minimum is not None and maximum is not None:
        expected = f"an integer in [{minimum}, {bound(maximum)}]" if minimum <= maximum else "no value (none fits here)"
    elif minimum is not None:
        expected = f"an integer >= {minimum}"
    elif maximum is not None:
        expected = f"an integer <= {bound(maximum)}"
    else:
        expected = "an integer"
    raise bad(path, value, expected if type(value) is int else f"{expected}, got {kind(value)}")


def integers(value: Any, path: str, minimum: int, maximum: int) -> list[int]:
    """`value`, a JSON array of integers within [minimum, maximum]."""
    return [integer(x, at(path, i), minimum, maximum) for i, x in enumerate(array(value, path))]


def number(value: Any, path: str, minimum: float = 0.0) -> float:
    """`value`, a finite JSON number >= minimum (an integer is a number)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value < minimum:
        raise bad(path, value, f"a finite number >= {minimum:g}")
    return float(value)


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
