"""The value checks every part shares: integers, finite numbers, tables of known keys, yes/no
environment variables (numpy only, no MLX). Every refusal starts with the value's name or path.

A position, an id, a capacity is an integer. Lists, numpy arrays and anything
numpy can read (an MLX array included) are accepted where an array is; floats,
bools and NaN are refused by name, because numpy would otherwise coerce `True`
to 1 or `2.0` to 2 without a word. Each check takes `error`: the exception
type to raise (or any callable making one from the message, such as a state
file's `refuse`), so each caller keeps its own error class.

A value read from JSON (a state file, a request's body) is quoted as JSON
writes it, cut short, and its kind named as JSON names it (`from_json`);
any other is quoted by its repr and its Python type.
"""

from __future__ import annotations

import json
import math
import numbers
import os
from array import array
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from kvlayout.errors import ConfigError, KVLayoutError

ErrorFactory = Callable[[str], Exception]

INT64_MAX = 2**63 - 1  # a count, an id, a position: nothing larger is stored anywhere


# -- how a refusal quotes a value


def shown(value: Any, width: int = 60) -> str:
    """`value` as JSON writes it, cut to `width` characters (a damaged field may be huge)."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= width else text[: width - 1] + "…"


def kind(value: Any) -> str:
    """What JSON calls `value`'s type, as it reads in a sentence ("an array", "null")."""
    return {type(None): "null", dict: "an object", list: "an array", str: "a string", bool: "a bool",
            int: "an integer", float: "a number"}.get(type(value), type(value).__name__)


def _quoted(value: Any, from_json: bool) -> tuple[str, str]:
    """(the value, its kind) as a refusal says them."""
    return (shown(value), kind(value)) if from_json else (repr(value), type(value).__name__)


def _bound(n: int) -> str:
    """An integer bound as a reader takes it in: a large power of two minus one as one (2**128 - 1)."""
    return f"2**{(n + 1).bit_length() - 1} - 1" if n > 2**32 and (n + 1) & n == 0 else str(n)


def expected_integer(minimum: int | None = None, maximum: int | None = None) -> str:
    """What a refusal says was expected of an integer within [minimum, maximum] (either optional)."""
    if maximum == INT64_MAX:
        return "an integer" + (f" >= {minimum}" if minimum is not None else "") + " that fits in 64 bits"
    if minimum is not None and maximum is not None:
        return f"an integer in [{minimum}, {_bound(maximum)}]" if minimum <= maximum else "no value (none fits here)"
    if minimum is not None:
        return f"an integer >= {minimum}"
    if maximum is not None:
        return f"an integer <= {_bound(maximum)}"
    return "an integer"


# -- the checks


def int_array(name: str, values: Any, error: type[KVLayoutError] | ErrorFactory) -> np.ndarray:
    """`values` as a 1-d int64 array; `error` naming `name` if it is not integers."""
    if type(values) is np.ndarray and values.dtype == np.int64 and values.ndim == 1:
        return values  # what the checks below answer for it, without them (engines pass these every step)
    ends = (values.start, values.stop) if type(values) is range else None
    if ends is not None and -INT64_MAX <= min(ends) and max(ends) <= INT64_MAX:
        # integers by construction (a sequence's positions), every one fitting in 64 bits
        return np.arange(values.start, values.stop, values.step, dtype=np.int64)
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
    if arr.dtype.kind not in "iu":  # numpy's integers (np.issubdtype(., np.integer)), never bool
        raise error(f"{name}: expected integers, got dtype {arr.dtype} ({arr.tolist()!r:.80})")
    return arr.astype(np.int64, copy=False)


# Up to this many integers, a step's ids, positions or cells are handled in Python: on a step's path numpy's
# calls run cold (the model's work in between evicts them), at several microseconds each, more than the whole
# Python check of a decode step's few tokens.
FEW_ON_STEP = 32
_INT_ONLY = {int}


def frozen_ints(values: Any) -> np.ndarray | None:
    """`values` as an int64 array `[T]` no one can write or make writable (its memory an immutable bytes
    object, as `kvlayout.positions.frozen` makes), in one numpy call, when it is a list of at most
    FEW_ON_STEP Python ints that fit in 64 bits; else None (bools too: `int_array` refuses them)."""
    if type(values) is not list or len(values) > FEW_ON_STEP or (values and set(map(type, values)) != _INT_ONLY):
        return None  # (the types asked in C: a generator's frame costs a decode step ~10 opcodes a token)
    try:
        return np.frombuffer(array("q", values).tobytes(), dtype=np.int64)  # [T] already: a view, as frozen's
    except OverflowError:
        return None  # past 64 bits: int_array says which


def int_scalar(
    name: str,
    value: Any,
    error: type[KVLayoutError] | ErrorFactory,
    minimum: int | None = None,
    maximum: int | None = None,
    numpy: bool = True,
    from_json: bool = False,
) -> int:
    """`value` as an int within [minimum, maximum] (either bound optional); `error` naming `name` otherwise.

    `numpy=False` refuses numpy integers too: a config or a state file holds
    Python ints, which stay JSON-serializable. `from_json`: the value came
    from JSON, and is quoted so.
    """
    if type(value) is int and (minimum is None or value >= minimum) and (maximum is None or value <= maximum):
        return value  # the usual value (a bool is a subclass, never this type), settled without the rest
    kinds = (int, np.integer) if numpy else int
    is_int = isinstance(value, kinds) and not isinstance(value, (bool, np.bool_))
    if is_int and (minimum is None or value >= minimum) and (maximum is None or value <= maximum):
        return int(value)
    quoted, what = _quoted(value, from_json)
    got = "" if is_int else f", got {what}"
    raise error(f"{name}={quoted}: expected {expected_integer(minimum, maximum)}{got}")


def finite(value: Any) -> bool:
    """Whether `value` is a finite real number: an int or a float (numpy's too, never a bool),
    not NaN, not infinite, and not an int past the range of a float."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int past float range (10**400)
        return False


def finite_number(
    name: str,
    value: Any,
    error: type[KVLayoutError] | ErrorFactory,
    minimum: float | None = None,
    maximum: float | None = None,
    from_json: bool = False,
) -> float:
    """`value` as a float once it is `finite` and within [minimum, maximum] (either bound optional);
    `error` naming `name` otherwise. `from_json`: the value came from JSON, and is quoted so."""
    if finite(value) and (minimum is None or value >= minimum) and (maximum is None or value <= maximum):
        return float(value)
    if minimum is not None and maximum is not None:
        within = f" in [{minimum:g}, {maximum:g}]"
    elif minimum is not None:
        within = f" >= {minimum:g}"
    elif maximum is not None:
        within = f" <= {maximum:g}"
    else:
        within = ""
    raise error(f"{name}={_quoted(value, from_json)[0]}: expected a finite number{within}")


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
        raise ConfigError(
            f"{where}: unknown key{'s' if len(unknown) > 1 else ''} {names}; valid keys: {', '.join(valid)}"
        )
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
