"""OpenAI's response objects, as plain dicts: completions, stream chunks, usage, errors.

The shapes the official client parses (`openai.types.chat.ChatCompletion`,
`ChatCompletionChunk`, `Completion`): ids `chatcmpl-...`/`cmpl-...`, one
`created` per request shared by all its chunks, `finish_reason` "stop" or
"length", usage with `prompt_tokens_details.cached_tokens` (the prompt
tokens reused from cached cells rather than prefilled).
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def completion(
    chat: bool, rid: str, created: int, model: str, texts: Sequence[str], reasons: Sequence[str], use: dict,
    logprobs: Sequence[dict | None] | None = None, tool_calls: Sequence[list[dict] | None] | None = None,
) -> dict:
    """A whole answer: one choice per sample (with its logprobs object, `chat_logprobs` or
    `text_logprobs`, when the request asked for them; a chat choice with its `tool_calls`, when it
    made some: its content then null when it wrote nothing else)."""
    logprobs = logprobs or [None] * len(texts)
    tool_calls = tool_calls or [None] * len(texts)
    if chat:
        choices = [
            {"index": i, "message": message(t, calls), "finish_reason": r, "logprobs": lp}
            for i, (t, r, lp, calls) in enumerate(zip(texts, reasons, logprobs, tool_calls))
        ]
    else:
        choices = [
            {"index": i, "text": t, "finish_reason": r, "logprobs": lp}
            for i, (t, r, lp) in enumerate(zip(texts, reasons, logprobs))
        ]
    obj = "chat.completion" if chat else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": choices, "usage": use}


def message(text: str, calls: list[dict] | None) -> dict:
    """A chat choice's message: its text, and its tool calls when it made some (then its content is
    null unless it wrote something beside them)."""
    if not calls:
        return {"role": "assistant", "content": text}
    return {"role": "assistant", "content": text or None, "tool_calls": calls}


def chunk(chat: bool, rid: str, created: int, model: str, index: int, text: str | None, reason: str | None,
          first: bool = False, logprobs: dict | None = None, tool_calls: list[dict] | None = None) -> dict:
    """One stream event of choice `index`: new text (None: none), and its finish_reason when it ends;
    `logprobs`: the logprobs object of the tokens since the last event, when the request asked;
    `tool_calls`: the calls completed since the last event, each whole in one delta (with its index
    among the choice's calls, as OpenAI's deltas number them).

    A chat stream's first chunk of a choice carries `role: assistant`, as OpenAI's does."""
    if chat:
        delta: dict = {"role": "assistant"} if first else {}
        if text is not None:
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = tool_calls
        choice = {"index": index, "delta": delta, "finish_reason": reason, "logprobs": logprobs}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text or "", "finish_reason": reason, "logprobs": logprobs}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}


def usage_chunk(chat: bool, rid: str, created: int, model: str, use: dict) -> dict:
    """`stream_options.include_usage`: the last chunk before [DONE], no choices, the usage."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": use}


def error(message: str, kind: str = "invalid_request_error", param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def models(model_id: str, created: int) -> dict:
    return {"object": "list", "data": [{"id": model_id, "object": "model", "created": created, "owned_by": "kvlayout"}]}


# -- logprobs (engines.shaping.TokenLogprob records, the tokens' bytes by `token_bytes`)


def token_text(raw: bytes) -> str:
    """A token's text as OpenAI writes it: the UTF-8 it holds, or, when it holds part of a
    character, `bytes:` and its bytes escaped (`bytes:\\xe2\\x80`)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def chat_logprobs(records: Sequence, token_bytes: Callable[[int], bytes]) -> dict:
    """Chat's `logprobs` object: one entry per token, each with its top alternatives."""

    def entry(token: int, logprob: float) -> dict:
        raw = token_bytes(token)
        return {"token": token_text(raw), "logprob": logprob, "bytes": list(raw)}

    content = [{**entry(r.token, r.logprob), "top_logprobs": [entry(t, lp) for t, lp in r.top]} for r in records]
    return {"content": content, "refusal": None}


class TextOffsets:
    """Where the next token of a choice's text starts, in characters, as its tokens' bytes arrive: the
    characters the bytes so far decode to with "replace", a character still incomplete written as a
    decode of them all would write it. Counted as they come: a long echo costs one pass, not one per token."""

    def __init__(self):
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.chars = 0  # characters the bytes decoded to, the pending ones (at most 3 bytes) aside

    def at(self) -> int:
        pending, _ = self.decoder.getstate()
        return self.chars + len(pending.decode("utf-8", errors="replace"))

    def add(self, raw: bytes) -> None:
        self.chars += len(self.decoder.decode(raw))


def text_logprobs(records: Sequence, token_bytes: Callable[[int], bytes], offsets: TextOffsets | None = None) -> dict:
    """The legacy completion's `logprobs` object, its tokens following the text `offsets` has counted (a
    fresh count: the start); each token's `text_offset` counts the characters before it. Two alternatives
    with one text keep the likelier one's logprob."""
    offsets = TextOffsets() if offsets is None else offsets
    tokens, starts = [], []
    for r in records:
        starts.append(offsets.at())
        raw = token_bytes(r.token)
        tokens.append(token_text(raw))
        offsets.add(raw)
    top: list[dict | None] = [{} if r.logprob is not None else None for r in records]  # an echoed first token: None
    for alternatives, r in zip(top, records):
        for t, lp in r.top:
            alternatives.setdefault(token_text(token_bytes(t)), lp)
    return {"tokens": tokens, "token_logprobs": [r.logprob for r in records], "top_logprobs": top,
            "text_offset": starts}
