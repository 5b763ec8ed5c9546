"""Reading the JSON files of a model directory (config.json, tokenizer_config.json, generation_config.json).

They come with a downloaded model, so each is the user's file: anything wrong
with one (not readable, not UTF-8, not JSON, not an object) is a ConfigError
naming the file, never an exception from the json module.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvlayout.errors import ConfigError, os_reason


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in the file at `path`; ConfigError naming the file otherwise."""
    path = Path(path)
    text = read_text(path)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object {{...}}, got a JSON {_json_kind(data)}")
    return data


def _json_kind(value: Any) -> str:
    kinds = {list: "array", str: "string", bool: "boolean", type(None): "null", int: "number", float: "number"}
    return kinds.get(type(value), type(value).__name__)


def read_text(path: Path) -> str:
    """The UTF-8 text of `path`; ConfigError naming the file when it cannot be read or is not UTF-8."""
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:  # missing, a directory, unreadable
        raise ConfigError(f"{path}: cannot be read ({os_reason(exc)})") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start})") from None
