"""The argument checks every part shares: integers, tables of known keys, yes/no environment
variables (numpy only, no MLX).

A position, an id, a capacity is an integer. Lists, numpy arrays and anything
numpy can read (an MLX array included) are accepted where an array is; floats,
bools and NaN are refused by name, because numpy would otherwise coerce `True`
to 1 or `2.0` to 2 without a word. Each check takes `error`: the exception
type to raise (or any callable making one from the message, such as a state
file's `refuse`), so each caller keeps its own error class.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Iterable, Mapping

import numpy as np

from kvlayout.errors import ConfigError, KVLayoutError

ErrorFactory = Callable[[str], Exception]


def int_array(name: str, values: Any, error: type[KVLayoutError] | ErrorFactory) -> np.ndarray:
    """`values` as a 1-d int64 array; `error` naming `name` if it is not integers."""
    if isinstance(values, (list, tuple)) and not {bool, np.bool_}.isdisjoint(map(type, values)):  # no subclasses
        raise error(f"{name}: expected integers, got a bool in {list(values)!r}")
    try:
        arr = np.asarray(values)
    except Exception as exc:  # e.g. an MLX dtype numpy cannot hold
        raise error(f"{name}: expected a 1-d sequence of integers, got {type(values).__name__} ({exc})") from exc
    if arr.ndim != 1:
        raise error(f"{name}: expected a 1-d sequence of integers, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    wide = []
    if arr.dtype == object or arr.dtype == np.uint64:  # only these can hold an int past int64
        wide = [x for x in arr.tolist() if isinstance(x, int) and not -(2**63) <= x < 2**63]
    if wide:  # a Python int numpy kept as object, or a uint64 that int64 would wrap negative
        raise error(f"{name}: {wide[0]} does not fit in 64 bits: expected int64 integers")
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise error(f"{name}: expected integers, got dtype {arr.dtype} ({arr.tolist()!r:.80})")
    return arr.astype(np.int64, copy=False)


def int_scalar(
    name: str,
    value: Any,
    error: type[KVLayoutError] | ErrorFactory,
    minimum: int | None = None,
    maximum: int | None = None,
    numpy: bool = True,
) -> int:
    """`value` as an int within [minimum, maximum] (either bound optional); `error` naming `name` otherwise.

    `numpy=False` refuses numpy integers too: a config or a state file holds
    Python ints, which stay JSON-serializable.
    """
    kinds = (int, np.integer) if numpy else int
    is_int = isinstance(value, kinds) and not isinstance(value, (bool, np.bool_))
    if is_int and (minimum is None or value >= minimum) and (maximum is None or value <= maximum):
        return int(value)
    if minimum is not None and maximum is not None:
        expected = f"an integer in [{minimum}, {maximum}]"
    elif minimum is not None:
        expected = f"an integer >= {minimum}"
    elif maximum is not None:
        expected = f"an integer <= {maximum}"
    else:
        expected = "an integer"
    got = "" if is_int else f", got {type(value).__name__}"
    raise error(f"{name}={value!r}: expected {expected}{got}")


def reject_unknown(
    data: Any, valid: Iterable[str], where: str, prefix: str = "", required: Iterable[str] = ()
) -> Mapping[str, Any]:
    """`data`, once it is a mapping with keys among `valid` and every `required` one; else ConfigError.

    `where` starts the message (a class name, or a config file); `prefix`
    qualifies the keys it names as a TOML user writes them (`cache.capacty`).
    """
    valid = list(valid)
    if not isinstance(data, Mapping):
        what = f"{where}: {prefix}" if prefix else where
        raise ConfigError(f"{what}: expected a table (mapping), got {type(data).__name__}")
    unknown = sorted(set(data) - set(valid))
    if unknown:
        names = ", ".join(repr(f"{prefix}.{k}" if prefix else k) for k in unknown)
        raise ConfigError(f"{where}: unknown key{'s' if len(unknown) > 1 else ''} {names}; valid keys: {', '.join(valid)}")
    missing = [k for k in required if k not in data]
    if missing:
        names = ", ".join(repr(f"{prefix}.{k}" if prefix else k) for k in missing)
        raise ConfigError(f"{where}: missing required key{'s' if len(missing) > 1 else ''} {names}")
    return data


YES = ("1", "true", "yes", "on")
NO = ("0", "false", "no", "off", "")


def env_flag(name: str, environ: Mapping[str, str] = os.environ) -> bool:
    """The yes/no environment variable `name`: one of YES or NO (any case; unset is no).
    ConfigError for any other value, which would otherwise be taken as one or the other without a word."""
    value = environ.get(name, "")
    word = value.strip().lower()
    if word in YES:
        return True
    if word in NO:
        return False
    raise ConfigError(
        f"{name}={value!r}: expected one of {', '.join(YES)} (on) or {', '.join(NO[:-1])} (off), or unset"
    )
