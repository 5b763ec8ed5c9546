"""Chat templates: a conversation rendered to prompt text the way Hugging Face renders it.

A model directory's template is `chat_template.jinja` when there is one,
else `chat_template` in `tokenizer_config.json` (a string, or a list of
named templates of which "default" is used), exactly where transformers
looks. It is rendered like transformers' `apply_chat_template`: an immutable
sandboxed jinja2 environment with `trim_blocks` and `lstrip_blocks`, the
loop controls, `raise_exception`, `strftime_now` and a `tojson` that does
not escape HTML; the template sees `messages`, `add_generation_prompt` and
the tokenizer's special tokens (`bos_token`, `eos_token`, `unk_token`,
`pad_token`). Templates come from the Hub and are untrusted code: the
sandbox is the point.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvlayout.errors import ConfigError, one_line
from kvlayout.models.files import read_json_object, read_text

ROLES = ("system", "user", "assistant")
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")
TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"
CONTENT_MARK = "\U000f8a1d"  # a private-use character around a content's index (render_parts)


class ChatTemplate:
    """A model's chat template; `render(messages)` gives the prompt text (ConfigError naming
    `origin` when the template does not compile, refuses the messages, or fails on them)."""

    def __init__(self, source: str, specials: Mapping[str, str], origin: str):
        self.source = source
        self.specials = dict(specials)
        self.origin = origin

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """The template's text for `messages`; `tools` (OpenAI's function tools) go to the template's
        `tools`, as transformers' apply_chat_template(tools=...) passes them (left out when None)."""
        context = {} if tools is None else {"tools": [dict(t) for t in tools]}
        try:
            template = compile_template(self.source)
            return template.render(
                messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt, **self.specials,
                **context,
            )
        except jinja2.TemplateSyntaxError as exc:
            raise ConfigError(
                f"{self.origin}: the chat template does not compile (line {exc.lineno}: {exc.message})"
            ) from None
        except jinja2.TemplateError as exc:  # raise_exception, or the sandbox refusing something
            raise ConfigError(f"{self.origin}: the chat template refused the messages: {one_line(exc)}") from None
        except Exception as exc:  # untrusted code: `{{ 1/0 }}` or `{{ content + 1 }}` fails in Python itself
            raise ConfigError(
                f"{self.origin}: the chat template failed on the messages ({type(exc).__name__}: {one_line(exc)})"
            ) from None

    def render_parts(self, messages: Sequence[Mapping[str, Any]], rendered: str,
                     tools: Sequence[Mapping[str, Any]] | None = None) -> list[tuple[str, bool]] | None:
        """`rendered` (this template's text for `messages` and `tools`) cut into the template's own text
        and the messages' contents, in order: (text, is_content). Found by rendering again with a
        marker in place of each content; None when the template changes a content (trims it, say) so
        that the markers do not give back `rendered`."""
        marked = [{**m, "content": f"{CONTENT_MARK}{i}{CONTENT_MARK}"} for i, m in enumerate(messages)]
        pieces = self.render(marked, tools=tools).split(CONTENT_MARK)
        parts = []
        for k, piece in enumerate(pieces):
            if k % 2 == 0:
                parts.append((piece, False))
            elif piece.isdigit() and int(piece) < len(messages):
                parts.append((messages[int(piece)]["content"], True))
            else:
                return None
        return parts if "".join(text for text, _ in parts) == rendered else None


class GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: transformers marks assistant text with it; it renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("body"), [], [], body).set_lineno(lineno)

    def body(self, caller) -> str:
        return caller()


def raise_exception(message: str):
    raise jinja2.TemplateError(message)


def tojson(x: Any, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    # jinja's own tojson escapes HTML characters, which a prompt must keep as they are.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.cache
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def read_tokenizer_config(model_dir: Path) -> dict[str, Any]:
    """tokenizer_config.json as a dict ({} when the directory has none)."""
    path = Path(model_dir) / TOKENIZER_CONFIG
    return read_json_object(path) if path.is_file() else {}


def read_chat_template(model_dir: Path) -> ChatTemplate | None:
    """The directory's chat template, or None when it has none."""
    model_dir = Path(model_dir)
    config = read_tokenizer_config(model_dir)
    specials = {k: t for k in SPECIAL_TOKENS if (t := _token_text(config.get(k))) is not None}
    jinja_file = model_dir / TEMPLATE_FILE
    if jinja_file.is_file():
        return ChatTemplate(read_text(jinja_file), specials, str(jinja_file))
    origin = str(model_dir / TOKENIZER_CONFIG)
    source = config.get("chat_template")
    if source is None:
        return None
    if isinstance(source, list):
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, Mapping)}
        if "default" not in named:
            raise ConfigError(
                f"{origin}: chat_template lists templates {sorted(map(str, named))} but none named 'default'"
            )
        source = named["default"]
    if not isinstance(source, str):
        raise ConfigError(f"{origin}: chat_template: expected a string or a list of named templates")
    return ChatTemplate(source, specials, origin)
