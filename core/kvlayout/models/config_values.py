"""The values of a Hugging Face config file, checked one key at a time.

A config.json comes with a downloaded model (or is written by hand), so every
value is the user's: a wrong type or range is a ConfigError naming the file,
the key, the value and what is allowed, never a ValueError from `int()` or a
ZeroDivisionError three calls later. JSON gives Python ints, floats and bools,
and a bool is never taken for a number (`true` is not 1 here).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvlayout.checks import finite, int_scalar
from kvlayout.errors import ConfigError

REQUIRED = object()  # `default` for a key the model cannot do without


def integer(cfg: Mapping[str, Any], key: str, source: str, minimum: int = 1, default: Any = REQUIRED) -> int:
    """cfg[key] as an int >= minimum; `default` when the key is absent or null (REQUIRED: missing is an error)."""
    value = cfg.get(key)
    if value is None and default is not REQUIRED:
        return default
    if key not in cfg:
        raise ConfigError(f"{source}: missing key {key!r}")
    return int_scalar(f"{source}: {key}", value, ConfigError, minimum, numpy=False)


def number(cfg: Mapping[str, Any], key: str, source: str, default: float) -> float:
    """cfg[key] as a finite float > 0 (an int is a number too); `default` when the key is absent."""
    return positive_number(cfg.get(key, default), key, source)


def positive_number(value: Any, key: str, source: str) -> float:
    if finite(value) and value > 0:
        return float(value)
    raise ConfigError(f"{source}: {key}={value!r}: expected a number > 0")


def boolean(cfg: Mapping[str, Any], key: str, source: str, default: bool) -> bool:
    """cfg[key], which must be true or false (a string "false" is not false); `default` when absent."""
    value = cfg.get(key, default)
    if isinstance(value, bool):
        return value
    raise ConfigError(f"{source}: {key}={value!r}: expected true or false")


def token_ids(value: Any, key: str, source: str) -> tuple[int, ...]:
    """An id key as HF writes it (`eos_token_id`): a token id, a list of them, or null (none)."""
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    if all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        return tuple(values)
    raise ConfigError(f"{source}: {key}={value!r}: expected a token id (an integer >= 0), a list of them, or null")
