"""A client's request body, checked field by field, as an `Order` the engine thread can run.

OpenAI's fields, with OpenAI's meaning: `model`, `messages` (chat) or
`prompt` (text, or token ids), `max_tokens` (`max_completion_tokens` on
chat), `temperature`, `top_p`, `seed`, `n`, `stop`, `stream`,
`stream_options.include_usage`, `presence_penalty`, `frequency_penalty`,
`logit_bias`, `logprobs` (chat: with `top_logprobs`; legacy: the number of
alternatives), the legacy `echo` (the prompt before the answer; with
logprobs, the prompt's own, as lm-evaluation-harness's loglikelihood asks),
chat's `response_format` (text, json_object, json_schema: compiled to a
grammar the engine decodes under, kvlayout.grammar), chat's `tools`,
`tool_choice` and `parallel_tool_calls` with tool calls and results in the
history (server.tools: rendered by a template that teaches `<tool_call>`
blocks; a forced choice compiled to a grammar too); and vLLM's `cache_salt`
(a non-empty string: only requests with the same salt, under the same API
key, share cached prefixes; `Order.cache_salt`, server.service). Fields we
cannot honour are accepted only at the value that means "off" (`best_of:
1`, no `suffix`): anything else is refused rather than silently ignored, as
is a field we do not know. Fields that cannot change the answer are checked
as OpenAI checks them and then ignored: `user`, `metadata`, `service_tier`,
`reasoning_effort` (none of our models reasons),
`stream_options.include_obfuscation`, a message's `name`, the empty fields
the OpenAI SDK echoes of an answer's message (`refusal: null`...).
Every refusal is a `BadRequest` naming the field (`param`), which
the app answers with OpenAI's error object; nothing of the server changes.

A text far too long for the cache is refused before it is encoded (encoding a
megabyte takes seconds): the tokenizer's `fewest_tokens` is a lower bound on
its token count taken at the speed of a byte count (one token per byte for
the byte tokenizer; for a byte-level BPE, the text's bytes over its longest
token's, `models.tokenizer.byte_level_bound`; 0, no early refusal, for any
other tokenizer). The app runs these parsers off its event loop all the same.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from kvlayout.checks import finite_number, int_scalar, shown
from kvlayout.errors import BadRequest, ConfigError
from kvlayout.models.chat import ROLES
from kvlayout.runner.config import Message, RequestSpec
from kvlayout.runner.prompts import build_prompt, encode_chat, plain_text
from kvlayout.server.tools import Tools, carries_tools, detects, parse_tools, template_message, tool_call_grammar

MAX_STOP = 4  # OpenAI's limit on stop strings
MAX_SEED = 2**63 - 1
STREAM_OPTIONS = ("include_usage", "include_obfuscation")
# Fields accepted only with the value that asks for nothing we would have to do.
NEUTRAL = {
    "user": None,  # any string: an end-user id OpenAI uses for abuse monitoring; nothing to do here
    "best_of": (None, 1),
    "suffix": (None,),
    # OpenAI keeps a stored completion for reading back later; this server keeps none (no route to read one
    # back), so asking for it is refused rather than answered as if it were kept.
    "store": (None, False),
    "metadata": None,  # tags (16 string pairs) OpenAI keeps with a stored completion; we store nothing
    # Fields any of their documented values leaves the output as it is here, checked as OpenAI checks them
    # (IGNORED) and otherwise ignored: how fast a tier would serve it; how hard a reasoning model would think
    # (none of ours reasons; OpenAI's own non-reasoning models ignore it too).
    "service_tier": None,
    "reasoning_effort": None,
}
IGNORED = {
    "service_tier": ("auto", "default", "flex", "scale", "priority", "fast"),
    "reasoning_effort": ("none", "minimal", "low", "medium", "high", "xhigh", "max"),
}
METADATA_PAIRS, METADATA_KEY, METADATA_VALUE = 16, 64, 512  # OpenAI's bounds on metadata
COMMON = ("model", "max_tokens", "temperature", "top_p", "seed", "n", "stop", "stream", "stream_options", "cache_salt",
          "presence_penalty", "frequency_penalty", "logit_bias", "logprobs")
CHAT_FIELDS = (*COMMON, "messages", "max_completion_tokens", "top_logprobs", "response_format", "tools", "tool_choice",
               "parallel_tool_calls")
TEXT_FIELDS = (*COMMON, "prompt", "echo")
NEUTRAL_CHAT = ("user", "store", "metadata", "service_tier", "reasoning_effort")
NEUTRAL_TEXT = ("user", "best_of", "suffix")
ECHOED_EMPTY = {"tool_calls": (None, []), "function_call": (None,), "refusal": (None,), "audio": (None,),
                "annotations": (None, [])}
MAX_TOP_LOGPROBS = 20  # OpenAI's bound on chat's top_logprobs; the legacy logprobs: N is held to it too
PENALTY = 2.0  # presence_penalty and frequency_penalty lie in [-2, 2]
BIAS = 100.0  # a logit_bias value lies in [-100, 100]


@attrs.frozen
class Limits:
    """What a request is checked against: the served model and the server's limits."""

    model_id: str
    capacity: int  # cells of the cache: a request's prompt plus n x max_tokens must fit
    max_tokens: int
    max_n: int
    vocab_size: int
    temperature: float  # [sampling] defaults
    top_p: float
    seed: int


@attrs.frozen
class Order:
    """A checked request: what the engine thread runs and how the answer is shaped."""

    chat: bool
    prompt: list[int]
    max_tokens: int
    n: int
    stop: tuple[str, ...]
    temperature: float
    top_p: float
    seed: int
    stream: bool
    include_usage: bool
    seeded: bool = False  # the request gave its seed: its samples are reproducible
    cache_salt: str | None = None  # vLLM's field: prefixes are shared only with requests of the same salt
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (id, amount), ids ascending
    logprobs: int | None = None  # alternatives reported per token (chat's top_logprobs, legacy logprobs); None: off
    grammar: Any = None  # response_format's or a forced tool call's grammar (kvlayout.grammar.Grammar); None: free
    tools: Any = None  # the chat's tools (server.tools.Tools): its replies are read for calls; None: none given
    echo: str | None = None  # the legacy echo: the prompt's text, written before each answer; None: not asked
    # max_tokens 0 (only with echo): the engine generates one token, which the answer leaves out (app.Logprobs)


def parse_chat(body: Any, limits: Limits, tokenizer: Any, plain_chat: bool, grammars: Any = None) -> Order:
    """`POST /v1/chat/completions`'s body as an Order; BadRequest naming the field otherwise.
    `grammars` (kvlayout.grammar.Grammars) compiles a response_format; None: only "text" is taken."""
    body = _object(body)
    _known(body, CHAT_FIELDS, NEUTRAL_CHAT)
    grammar = response_grammar(body.get("response_format"), grammars)
    tools = parse_tools(body)
    if "max_completion_tokens" in body and body.get("max_tokens") is not None:
        raise BadRequest("give max_tokens or max_completion_tokens, not both", "max_completion_tokens")
    limit_field = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    raw = body.get("messages")
    # tool_choice "none" and no calls in the history: the tools cannot change the answer; no template reads them.
    if (tools is not None and tools.calls_allowed) or (isinstance(raw, list) and any(carries_tools(m) for m in raw)):
        ids = _tool_chat_ids(raw, tools, tokenizer, limits)
        grammar = forced_call(tools, grammar, grammars)
    else:
        ids = _chat_ids(_messages(raw), tokenizer, limits, plain_chat)
    order = _order(body, limits, ids, "messages", limit_field, chat=True)
    return attrs.evolve(order, grammar=grammar, tools=tools)


def _chat_ids(messages: tuple[Message, ...], tokenizer: Any, limits: Limits, plain_chat: bool) -> list[int]:
    """The prompt of a chat without tools: rendered by the model's template, or its contents joined."""
    spec = RequestSpec(messages=messages, where="request")
    if tokenizer.chat_template is None and plain_chat:
        # The model has no template (the server said so as it started): the contents, joined.
        text = plain_text(messages)
        _could_fit(text, tokenizer, limits, "messages")
        ids = tokenizer.encode_literal(text)  # a message's text is not markup (runner.prompts)
    else:
        try:
            if tokenizer.chat_template is not None:  # rendering is cheap; encoding a huge chat is not
                rendered = tokenizer.chat_template.render([attrs.asdict(m) for m in messages])
                _could_fit(rendered, tokenizer, limits, "messages")
            ids = build_prompt(0, spec, tokenizer, plain_chat)[0].ids
        except ConfigError as exc:
            # The runner names the field as its config does (requests[0].messages); here it is `messages`.
            why = re.sub(r"^(requests\[\d+\]|request)\.messages: ", "", str(exc))
            if tokenizer.chat_template is None:
                why += "; or send the text to /v1/completions"
            raise BadRequest(why, "messages") from None
    return ids


def _tool_chat_ids(value: Any, tools: Tools | None, tokenizer: Any, limits: Limits) -> list[int]:
    """The prompt of a chat with tools, or with tool calls and results in its history: the messages
    (server.tools.template_message for those) and the tools rendered by a template that teaches the
    call format the server reads; BadRequest for any other model. tool_choice "none" leaves the tools out."""
    template = tokenizer.chat_template
    if template is None or not detects(template.source):
        raise BadRequest("this model's chat template does not teach tool calls in a format this server reads "
                         "(<tool_call> blocks, as Qwen's and Hermes' templates write them); send the chat "
                         "without tools", "tools" if tools is not None else "messages")
    if not isinstance(value, list) or not value:
        _messages(value)  # its refusal
    messages = [template_message(m, f"messages[{i}]") if carries_tools(m) else
                attrs.asdict(_messages([m], first=i)[0]) for i, m in enumerate(value)]
    definitions = list(tools.definitions) if tools is not None and tools.calls_allowed else None
    try:
        text = template.render(messages, tools=definitions)
        _could_fit(text, tokenizer, limits, "messages")
        return encode_chat(text, messages, tokenizer, definitions)
    except ConfigError as exc:
        raise BadRequest(str(exc), "messages") from None


def forced_call(tools: Tools | None, grammar: Any, grammars: Any) -> Any:
    """The grammar of a reply tool_choice forces to be calls ("required", a named function), else `grammar`
    (response_format's). BadRequest when both would constrain it, or when the server has no grammars."""
    source = None if tools is None else tool_call_grammar(tools)
    if source is None:
        return grammar
    if grammar is not None:
        raise BadRequest("tool_choice forces a tool call and response_format a JSON answer; ask for one of them",
                         "tool_choice")
    if grammars is None:
        raise BadRequest(f"tool_choice {tools.choice} needs structured output, which is off on this server",
                         "tool_choice")
    return grammars.lark(source, "tools")


def parse_completion(body: Any, limits: Limits, tokenizer: Any) -> Order:
    """`POST /v1/completions`'s body as an Order; BadRequest naming the field otherwise."""
    body = _object(body)
    _known(body, TEXT_FIELDS, NEUTRAL_TEXT)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one: OpenAI's array form
    if isinstance(prompt, str):
        _unicode(prompt, "prompt")
        if not prompt:
            raise BadRequest("prompt is empty; give some text or token ids", "prompt")
        _could_fit(prompt, tokenizer, limits, "prompt")
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        ids = list(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise BadRequest(f"prompt holds {len(prompt)} prompts; send one prompt per request", "prompt")
    else:
        raise BadRequest(
            f"prompt must be a non-empty string or a non-empty array of token ids, not {shown(prompt)}", "prompt"
        )
    echo = body.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise BadRequest(f"echo must be true or false, not {shown(echo)}", "echo")
    # max_tokens 0 with echo scores the prompt and generates nothing (what scoring clients send): the
    # engine draws the one token the prompt's last logits give anyway, and the answer leaves it out.
    score_only = echo is True and body.get("max_tokens") == 0 and type(body.get("max_tokens")) is int
    order = _order({**body, "max_tokens": 1} if score_only else body, limits, ids, "prompt", "max_tokens", chat=False)
    # The prompt as its tokens spell it (a BOS the tokenizer adds included), so that the echoed text and the
    # prompt tokens' logprobs and text offsets agree.
    text = b"".join(tokenizer.token_bytes(t) for t in ids).decode("utf-8", errors="replace") if echo else None
    return attrs.evolve(order, echo=text, max_tokens=0 if score_only else order.max_tokens)


def _could_fit(text: str, tokenizer: Any, limits: Limits, field: str) -> None:
    """BadRequest, before encoding `text`, when even its fewest possible tokens leave no cell to generate in."""
    fewest = tokenizer.fewest_tokens(text)
    if fewest >= limits.capacity:
        raise BadRequest(
            f"{field} is at least {fewest} tokens ({len(text.encode('utf-8'))} bytes of text); it leaves no room "
            f"in the cache's {limits.capacity} cells", field, code="context_length_exceeded",
        )


def _order(body: Mapping, limits: Limits, ids: list[int], prompt_field: str, limit_field: str, chat: bool) -> Order:
    model = body.get("model")
    if not isinstance(model, str):
        raise BadRequest(
            f"model must be a string, the served model's id ({limits.model_id!r}), not {shown(model)}", "model"
        )
    if model != limits.model_id:
        raise BadRequest(
            f"the model {model!r} is not served here; this server serves {limits.model_id!r} (GET /v1/models)",
            "model", status=404, code="model_not_found",
        )
    if not ids:
        raise BadRequest(f"{prompt_field} encodes to no tokens", prompt_field)
    bad = [t for t in ids if not 0 <= t < limits.vocab_size]
    if bad:
        raise BadRequest(
            f"{prompt_field}: token id {bad[0]} is outside the vocabulary (0..{limits.vocab_size - 1})", prompt_field
        )
    n = _integer(body, "n", 1, 1, limits.max_n, "server.max_sequences")
    room = limits.capacity - len(ids)
    if room < n:
        raise BadRequest(
            f"{prompt_field} is {len(ids)} tokens; with n={n} it leaves no room in the cache's "
            f"{limits.capacity} cells", prompt_field, code="context_length_exceeded",
        )
    max_tokens = _integer(
        body, limit_field, min(limits.max_tokens, room // n), 1, limits.max_tokens, "server.max_tokens"
    )
    if len(ids) + n * max_tokens > limits.capacity:
        raise BadRequest(
            f"{prompt_field} is {len(ids)} tokens and {limit_field}={max_tokens} with n={n} needs "
            f"{len(ids) + n * max_tokens} cells, more than the cache's {limits.capacity}; "
            f"ask for at most {room // n} tokens", limit_field, code="context_length_exceeded",
        )
    temperature = _number(body, "temperature", limits.temperature, 0.0, 2.0)
    top_p = _number(body, "top_p", limits.top_p, 0.0, 1.0)
    if top_p == 0.0:
        raise BadRequest("top_p must be in (0, 1]", "top_p")
    seed = _integer(body, "seed", limits.seed, 0, MAX_SEED, None)
    stream = body.get("stream")
    if stream is None:
        stream = False
    elif not isinstance(stream, bool):
        raise BadRequest(f"stream must be true or false, not {shown(stream)}", "stream")
    include_usage = _stream_options(body.get("stream_options"), stream)
    seeded = body.get("seed") is not None
    return Order(
        chat, ids, max_tokens, n, _stop(body.get("stop")), temperature, top_p, seed, stream, include_usage, seeded,
        _cache_salt(body.get("cache_salt")), **shaping(body, limits.vocab_size, chat),
    )


def shaping(body: Mapping, vocab_size: int, chat: bool) -> dict:
    """The order's penalties, logit_bias and logprobs (engines.shaping), each checked as OpenAI checks it."""
    return {
        "presence_penalty": _number(body, "presence_penalty", 0.0, -PENALTY, PENALTY),
        "frequency_penalty": _number(body, "frequency_penalty", 0.0, -PENALTY, PENALTY),
        "logit_bias": _logit_bias(body.get("logit_bias"), vocab_size),
        "logprobs": _chat_logprobs(body) if chat else _text_logprobs(body),
    }


def _text_logprobs(body: Mapping) -> int | None:
    """The legacy `logprobs`: how many alternatives to report per token (0-20); null or false: none."""
    if body.get("logprobs") is False:  # what a client that means "none" may send
        return None
    return _integer(body, "logprobs", None, 0, MAX_TOP_LOGPROBS, None)


def _chat_logprobs(body: Mapping) -> int | None:
    """Chat's `logprobs` (true: report them) and `top_logprobs` (how many alternatives, 0-20; it needs logprobs)."""
    asked = body.get("logprobs")
    if asked is not None and not isinstance(asked, bool):
        raise BadRequest(f"logprobs must be true or false, not {shown(asked)}", "logprobs")
    top = _integer(body, "top_logprobs", None, 0, MAX_TOP_LOGPROBS, None)
    if top is not None and not asked:
        raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
    return (top or 0) if asked else None


def _logit_bias(value: Any, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias: {"token id": amount in [-100, 100]}, as (id, amount) pairs in id order."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise BadRequest(f"logit_bias must be an object mapping token ids to numbers, not {shown(value)}",
                         "logit_bias")
    pairs = {}
    for key, amount in value.items():
        at = f"logit_bias.{key}"
        if not re.fullmatch(r"0|[1-9][0-9]{0,9}", key) or int(key) >= vocab_size:
            raise BadRequest(f"{at}: the key must be a token id in 0..{vocab_size - 1}", at)
        pairs[int(key)] = finite_number(at, amount, lambda why, at=at: BadRequest(why, at), -BIAS, BIAS,
                                        from_json=True)
    return tuple(sorted(pairs.items()))


def response_grammar(value: Any, grammars: Any) -> Any:
    """The grammar a chat's response_format asks for: None for text (or none given), else
    `grammars`' compilation of {"type": "json_object"} or {"type": "json_schema", "json_schema":
    {"name", "schema", "strict", "description"}}; BadRequest naming the part otherwise."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in ("text", "json_object", "json_schema"):
        raise BadRequest("response_format must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                         f"{{\"type\": \"json_schema\", \"json_schema\": ...}}, not {shown(value)}",
                         "response_format")
    extra = [k for k in value if k not in ("type", "json_schema" if kind == "json_schema" else "type")]
    if extra:
        raise BadRequest(f"response_format.{extra[0]}: unrecognized field", f"response_format.{extra[0]}")
    if kind == "text":
        return None
    if grammars is None:
        raise BadRequest(f"response_format {kind} is not available on this server", "response_format")
    if kind == "json_object":
        return grammars.any_json()
    return _json_schema(value.get("json_schema"), grammars)


def _json_schema(spec: Any, grammars: Any) -> Any:
    at = "response_format.json_schema"
    if not isinstance(spec, dict):
        raise BadRequest(f"{at} must be an object with name and schema, not {shown(spec)}", at)
    unknown = [k for k in spec if k not in ("name", "schema", "strict", "description")]
    if unknown:
        raise BadRequest(f"{at}.{unknown[0]}: unrecognized field", f"{at}.{unknown[0]}")
    name = spec.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
        raise BadRequest(f"{at}.name must be 1-64 letters, digits, _ or -, not {shown(name)}", f"{at}.name")
    if not isinstance(spec.get("description", ""), str):
        raise BadRequest(f"{at}.description must be a string", f"{at}.description")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise BadRequest(f"{at}.strict must be true or false, not {shown(strict)}", f"{at}.strict")
    schema = spec.get("schema", {})  # OpenAI: absent, any JSON the model likes (an empty schema)
    if not isinstance(schema, dict):
        raise BadRequest(f"{at}.schema must be a JSON schema object, not {shown(schema)}", f"{at}.schema")
    return grammars.json_schema(schema, bool(strict), param=f"{at}.schema")


# -- the fields, one at a time


def _cache_salt(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise BadRequest(f"cache_salt must be a non-empty string, not {shown(value)}", "cache_salt")
    _unicode(value, "cache_salt")
    return value


def _object(body: Any) -> Mapping:
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, not {shown(body)}")
    return body


def _known(body: Mapping, fields: Sequence[str], neutral: Sequence[str]) -> None:
    for key, value in body.items():
        if key in fields:
            continue
        if key not in neutral:
            raise BadRequest(f"unrecognized request argument supplied: {key}", key)
        allowed = NEUTRAL[key]
        if allowed is None:
            _any_value(key, value)
            continue
        if not any(type(value) is type(a) and value == a for a in allowed):
            only = " or ".join("null" if a is None else json.dumps(a) for a in allowed)
            raise BadRequest(f"{key}={shown(value)} is not supported by this server (only {only})", key)


def _any_value(key: str, value: Any) -> None:
    """A field whose every valid value is ignored here, checked as OpenAI checks it (null: not given)."""
    if value is None:
        return
    if key == "user":
        if not isinstance(value, str):
            raise BadRequest(f"user must be a string, not {shown(value)}", key)
    elif key == "metadata":
        _metadata(value)
    elif value not in IGNORED[key] or not isinstance(value, str):
        raise BadRequest(f"{key} must be one of {', '.join(IGNORED[key])}, not {shown(value)}", key)


def _metadata(value: Any) -> None:
    """OpenAI's metadata: at most 16 pairs of strings, keys up to 64 characters, values up to 512."""
    if not isinstance(value, dict):
        raise BadRequest(f"metadata must be an object of string values, not {shown(value)}", "metadata")
    if len(value) > METADATA_PAIRS:
        raise BadRequest(f"metadata holds {len(value)} pairs; at most {METADATA_PAIRS}", "metadata")
    for k, v in value.items():
        if len(k) > METADATA_KEY:
            raise BadRequest(f"metadata: key {k[:20]!r}... is {len(k)} characters; at most {METADATA_KEY}",
                             "metadata")
        if not isinstance(v, str) or len(v) > METADATA_VALUE:
            raise BadRequest(f"metadata.{k} must be a string of at most {METADATA_VALUE} characters, not "
                             f"{shown(v)}", f"metadata.{k}")


def _messages(value: Any, first: int = 0) -> tuple[Message, ...]:
    """The messages of a chat (`first`: the index of value[0] in the request's, for the refusals' paths)."""
    if not isinstance(value, list) or not value:
        raise BadRequest(
            f"messages must be a non-empty array of {{role, content}} objects, not {shown(value)}", "messages"
        )
    out = []
    for i, m in enumerate(value, first):
        at = f"messages[{i}]"
        if not isinstance(m, dict):
            raise BadRequest(f"{at} must be an object with role and content, not {shown(m)}", at)
        # What the OpenAI SDK echoes of an answer's message (model_dump) is taken at its empty value.
        unknown = [k for k in m if k not in ("role", "content", "name")
                   and not (k in ECHOED_EMPTY and m[k] in ECHOED_EMPTY[k])]
        if unknown:
            raise BadRequest(f"{at}.{unknown[0]}: unrecognized message field", f"{at}.{unknown[0]}")
        # A participant's name (OpenAI's, on any role we take): checked, then dropped. It cannot change the
        # output here: chat templates do not read it (a Message has no name to give them), nor does plain text.
        name = m.get("name")
        if name is not None and not isinstance(name, str):
            raise BadRequest(f"{at}.name must be a string, not {shown(name)}", f"{at}.name")
        role = m.get("role")
        if role == "developer":  # OpenAI's newer name for the system role
            role = "system"
        if role not in ROLES:
            raise BadRequest(f"{at}.role must be one of {', '.join(ROLES)}, not {shown(role)}", f"{at}.role")
        out.append(Message(role, _content(m.get("content"), f"{at}.content")))
    return tuple(out)


def _content(value: Any, at: str) -> str:
    """A message's text: a string, or an array of text parts (joined as OpenAI joins them)."""
    if isinstance(value, str):
        return _unicode(value, at)
    if isinstance(value, list) and value:
        texts = []
        for j, part in enumerate(value):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise BadRequest(
                    f"{at}[{j}] must be a text part {{\"type\": \"text\", \"text\": ...}}; this model reads text only",
                    f"{at}[{j}]",
                )
            texts.append(_unicode(part["text"], f"{at}[{j}].text"))
        return "\n".join(texts)
    raise BadRequest(f"{at} must be a string or an array of text parts, not {shown(value)}", at)


def _integer(body: Mapping, key: str, default: int | None, low: int, high: int, limit_key: str | None) -> int | None:
    """body[key], an integer in [low, high] (`high` is this server's `limit_key` when one is named);
    `default` when it is absent."""
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # JSON has one number type; 2.0 is 2 (and 1e20 is above a maximum, below)
    limit = f"; {high} is this server's {limit_key}" if limit_key else ""
    return int_scalar(key, value, lambda why: BadRequest(why + limit, key), low, high, numpy=False, from_json=True)


def _number(body: Mapping, key: str, default: float, low: float, high: float) -> float:
    """body[key], a finite number in [low, high]; `default` when it is absent."""
    value = body.get(key)
    if value is None:
        return default
    return finite_number(key, value, lambda why: BadRequest(why, key), low, high, from_json=True)


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise BadRequest(f"stop must be a non-empty string or an array of them, not {shown(value)}", "stop")
    if len(stops) > MAX_STOP:
        raise BadRequest(f"stop holds {len(stops)} strings; at most {MAX_STOP}", "stop")
    return tuple(_unicode(s, "stop") for s in stops)


def _unicode(text: str, at: str) -> str:
    """`text` if it is Unicode a tokenizer can encode: JSON's \\ud800 escapes give lone surrogates."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise BadRequest(
            f"{at} holds a lone surrogate (U+{ord(exc.object[exc.start]):04X}); it is not Unicode text", at
        ) from None
    return text


def _stream_options(value: Any, stream: bool) -> bool:
    """include_usage. include_obfuscation (OpenAI pads each event with random characters to hide its
    length) is checked and ignored: it changes no text of the answer, and we send no padding."""
    if value is None:
        return False
    if not stream:
        raise BadRequest("stream_options is only allowed when stream is true", "stream_options")
    if not isinstance(value, dict) or any(k not in STREAM_OPTIONS for k in value):
        raise BadRequest(
            f"stream_options must be an object with {' and '.join(STREAM_OPTIONS)} only, not {shown(value)}",
            "stream_options",
        )
    for key in STREAM_OPTIONS:
        flag = value.get(key, False)
        if not isinstance(flag, bool):
            raise BadRequest(f"stream_options.{key} must be true or false, not {shown(flag)}", f"stream_options.{key}")
    return value.get("include_usage", False)
