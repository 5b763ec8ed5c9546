"""A model directory's text files read one way: every way one can fail is a ConfigError naming it.

config.json, generation_config.json, tokenizer_config.json and
chat_template.jinja come from wherever the user got the model. Bytes that
are not UTF-8, JSON that is not an object, a directory where a file should
be: each is the user's to fix, so each is one line naming the file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvlayout.errors import ConfigError


def read_text(path: Path) -> str:
    """The UTF-8 text of `path`; ConfigError when it cannot be read or is not UTF-8."""
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:  # missing, a directory, unreadable
        raise ConfigError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start})") from None


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in `path`; ConfigError when it cannot be read, is not JSON, or is not an object."""
    try:
        data = json.loads(read_text(path))
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data
