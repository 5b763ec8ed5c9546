"""OpenAI's response objects, as plain dicts: completions, stream chunks, usage, errors.

The shapes the official client parses (`openai.types.chat.ChatCompletion`,
`ChatCompletionChunk`, `Completion`): ids `chatcmpl-...`/`cmpl-...`, one
`created` per request shared by all its chunks, `finish_reason` "stop" or
"length", usage with `prompt_tokens_details.cached_tokens` (the prompt
tokens reused from cached cells rather than prefilled).
"""

from __future__ import annotations

from collections.abc import Sequence


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def completion(
    chat: bool, rid: str, created: int, model: str, texts: Sequence[str], reasons: Sequence[str], use: dict
) -> dict:
    """A whole answer: one choice per sample."""
    if chat:
        choices = [
            {"index": i, "message": {"role": "assistant", "content": t}, "finish_reason": r, "logprobs": None}
            for i, (t, r) in enumerate(zip(texts, reasons))
        ]
    else:
        choices = [
            {"index": i, "text": t, "finish_reason": r, "logprobs": None}
            for i, (t, r) in enumerate(zip(texts, reasons))
        ]
    obj = "chat.completion" if chat else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": choices, "usage": use}


def chunk(chat: bool, rid: str, created: int, model: str, index: int, text: str | None, reason: str | None,
          first: bool = False) -> dict:
    """One stream event of choice `index`: new text (None: none), and its finish_reason when it ends.

    A chat stream's first chunk of a choice carries `role: assistant`, as OpenAI's does."""
    if chat:
        delta: dict = {"role": "assistant"} if first else {}
        if text is not None:
            delta["content"] = text
        choice = {"index": index, "delta": delta, "finish_reason": reason, "logprobs": None}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text or "", "finish_reason": reason, "logprobs": None}
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
