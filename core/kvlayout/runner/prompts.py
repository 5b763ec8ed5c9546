"""Each request's prompt as token ids: text encoded, ids as given, a chat rendered by the model's template.

A chat (`messages`) is rendered with the model's chat template and encoded
as transformers' `apply_chat_template` encodes it: the special tokens the
template writes are parsed (`<|im_start|>` is one id) and none are added (a
template that wants a BOS writes it). The messages' own text is not markup: a
`<|im_end|>` a user writes stays those characters (as OpenAI and vLLM read user
content), so no message can close its turn or forge another's. A chat whose
contents hold no special token's text is encoded whole, exactly as before; one
that does is encoded in parts, the template's text with specials parsed and the
contents literally (`encode_literal`), which may split a merge at a content's
edge. A template that changes the contents it writes (a `trim`), so that they
cannot be told apart from its text, is refused such a chat. A model without a template refuses a
chat, naming the request, unless the run asked for plain text where there
is no template (`RunConfig.plain_chat`: `--prompt`, a fallback model); the
messages' contents are then joined with blank lines, and the run says so.
"""

from __future__ import annotations

from typing import Any

import attrs

from kvlayout.errors import ConfigError
from kvlayout.runner.config import RequestSpec, RunConfig


@attrs.frozen
class Prompt:
    ids: list[int]
    text: str  # the text the ids came from (a chat as rendered; ids given as such, decoded)
    messages: list[dict] | None = None  # a chat request's messages, as plain dicts


def plain_text(messages) -> str:
    """A chat as plain text, for a model that has no template: the contents, blank lines between."""
    return "\n\n".join(m.content for m in messages)


def build_prompt(i: int, spec: RequestSpec, tok: Any, plain_chat: bool) -> tuple[Prompt, bool]:
    """Request i's prompt, and whether its messages were sent as plain text."""
    where = f"requests[{i}]"
    if spec.prompt_ids is not None:
        return Prompt(list(spec.prompt_ids), tok.decode(spec.prompt_ids)), False
    if spec.prompt is not None:
        return Prompt(tok.encode(spec.prompt), spec.prompt), False
    messages = [attrs.asdict(m) for m in spec.messages]
    if tok.chat_template is None:
        if not plain_chat:
            raise ConfigError(
                f"{where}.messages: the model has no chat template (no chat_template in its "
                "tokenizer_config.json); give the request a prompt instead"
            )
        text = plain_text(spec.messages)
        return Prompt(tok.encode_literal(text), text, messages), True
    try:
        text = tok.chat_template.render(messages, add_generation_prompt=True)
        ids = encode_chat(text, messages, tok)
    except ConfigError as exc:
        raise ConfigError(f"{where}.messages: {exc}") from None
    return Prompt(ids, text, messages), False


def encode_chat(text: str, messages: list[dict], tok: Any, tools: list[dict] | None = None) -> list[int]:
    """The ids of `text`, the template's rendering of `messages` (and `tools`): its markup's special
    tokens parsed, the messages' contents read literally (the module docstring)."""
    specials = tok.special_texts
    if not any(s in m["content"] for m in messages for s in specials):
        return tok.encode(text, add_special_tokens=False)
    parts = tok.chat_template.render_parts(messages, text, tools)
    if parts is None:
        raise ConfigError(
            "a message's content holds a special token's text (e.g. <|im_end|>) and the chat template changes "
            "contents as it writes them, so they cannot be kept apart from its markup; remove the special token"
        )
    ids = []
    for part, is_content in parts:
        if part:
            ids += tok.encode_literal(part, add_special_tokens=False) if is_content else tok.encode(
                part, add_special_tokens=False)
    return ids


def build_prompts(cfg: RunConfig, tok: Any, vocab_size: int) -> tuple[list[Prompt], bool]:
    """Every request's prompt, checked: not empty, every id in the vocabulary. Also whether
    some chat was sent as plain text (the caller says so)."""
    prompts, joined = [], False
    for i, spec in enumerate(cfg.requests):
        prompt, plain = build_prompt(i, spec, tok, cfg.plain_chat)
        joined |= plain
        if not prompt.ids:
            raise ConfigError(f"requests[{i}].prompt encodes to no tokens; give a longer prompt")
        bad = [t for t in prompt.ids if t >= vocab_size]
        if bad:
            raise ConfigError(f"requests[{i}].prompt_ids: id {bad[0]} is outside the vocabulary (size {vocab_size})")
        prompts.append(prompt)
    return prompts, joined

