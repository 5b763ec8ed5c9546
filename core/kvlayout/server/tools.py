"""OpenAI tool calling, the parts that need no engine: the request's tools, the history's calls, the model's calls.

In: `parse_tools(body)` checks a chat body's `tools`, `tool_choice` and
`parallel_tool_calls` as OpenAI does and returns a `Tools` record (None
without tools); `template_message(m, at)` turns a history message that
carries tool calls (an assistant's `tool_calls`, a `tool` role's result) into
the dict a chat template reads.

Out: the Hermes format Qwen2.5/Qwen3 chat templates teach their models (and
`detects` recognises in a template): each call a block
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, possibly
after some text. `ToolCallReader` reads a sample's text as it streams, holds
back what may still become a block, and collects each call as its block
closes. `tool_call_grammar(tools)` is the llguidance (Lark) grammar that
forces such blocks for `tool_choice` "required" or a named function.

Choices, and why:
- A block whose JSON does not parse, lacks a name, or names no tool of the
  request stays in the content, word for word: the model's text is never
  lost, and a badly formed call is never a server error.
- Whitespace is a separator next to a call block: the whitespace before a
  block, and after one when another block or the end follows, is dropped
  (a reply that is only calls has empty content; the caller answers null).
  Whitespace after a block and before more text is kept, so "A\\n<block>\\nB"
  reads "A\\nB".
- `arguments` goes out as compact JSON text (OpenAI's form), and comes back
  from the history parsed: templates render `arguments | tojson`.
"""

from __future__ import annotations

import functools
import json
import re
import secrets
from collections.abc import Collection, Mapping
from typing import Any

import attrs
import llguidance

from kvlayout.checks import shown
from kvlayout.errors import BadRequest, one_line
from kvlayout.grammar import COMPILE_OPTIONS, shorten, strict_schema

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_TOOLS = 128  # OpenAI's bound on a request's tools
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
CHOICES = ("none", "auto", "required")
TOOL_FIELDS = ("type", "function")
FUNCTION_FIELDS = ("name", "description", "parameters", "strict")
# Fields of a response's message a client echoes back in its history (the OpenAI SDK's model_dump): taken at null.
ECHOED_NULLS = ("refusal", "annotations", "audio", "function_call")
ANY_OBJECT = {"type": "object"}


@attrs.frozen
class Tools:
    """A request's tools, checked. `definitions`: the tools as given, [{"type": "function", "function":
    {...}}], what a chat template's `tools` variable receives (pass `list(definitions)`); `choice`: "none",
    "auto", "required" or "function" (then `function` names the one to call); `parallel`: several calls
    allowed in one reply."""

    definitions: tuple[dict, ...]
    choice: str
    function: str | None = None
    parallel: bool = True

    @property
    def names(self) -> tuple[str, ...]:
        """The functions' names, in the order given."""
        return tuple(d["function"]["name"] for d in self.definitions)

    @property
    def calls_allowed(self) -> bool:
        """The reply may hold calls (tool_choice is not "none")."""
        return self.choice != "none"


# -- the request's tools


def parse_tools(body: Mapping) -> Tools | None:
    """`body`'s tools, tool_choice and parallel_tool_calls checked (OpenAI's rules); None without tools.
    BadRequest naming the field at fault."""
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise BadRequest(f"parallel_tool_calls must be true or false, not {shown(parallel)}", "parallel_tool_calls")
    value = body.get("tools")
    definitions = None if value is None else tool_definitions(value)
    names = tuple(d["function"]["name"] for d in definitions or ())
    choice, function = tool_choice(body.get("tool_choice"), names)
    if definitions is None:
        return None
    return Tools(definitions, choice, function, parallel is not False)


def tool_definitions(value: Any) -> tuple[dict, ...]:
    """The `tools` array checked: 1 to MAX_TOOLS function tools with distinct names."""
    if not isinstance(value, list) or not value:
        raise BadRequest(f"tools must be a non-empty array of function tools, not {shown(value)}", "tools")
    if len(value) > MAX_TOOLS:
        raise BadRequest(f"tools holds {len(value)} tools; at most {MAX_TOOLS}", "tools")
    seen: set[str] = set()
    for i, tool in enumerate(value):
        name = check_tool(tool, f"tools[{i}]")
        if name in seen:
            raise BadRequest(f"tools[{i}].function.name {name!r} is given twice; names must be unique",
                             f"tools[{i}].function.name")
        seen.add(name)
    return tuple(value)


def check_tool(tool: Any, at: str) -> str:
    """One tool, {"type": "function", "function": {...}}, checked; its function's name."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise BadRequest(f"{at} must be {{\"type\": \"function\", \"function\": {{...}}}}, not {shown(tool)}", at)
    unknown(tool, TOOL_FIELDS, at)
    function = tool.get("function")
    if not isinstance(function, dict):
        raise BadRequest(f"{at}.function must be an object with a name, not {shown(function)}", f"{at}.function")
    at = f"{at}.function"
    unknown(function, FUNCTION_FIELDS, at)
    name = function.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise BadRequest(f"{at}.name must be 1-64 letters, digits, _ or -, not {shown(name)}", f"{at}.name")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise BadRequest(f"{at}.description must be a string, not {shown(description)}", f"{at}.description")
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise BadRequest(f"{at}.strict must be true or false, not {shown(strict)}", f"{at}.strict")
    parameters = function.get("parameters")
    if parameters is not None:
        check_parameters(parameters, bool(strict), f"{at}.parameters")
    return name


def check_parameters(parameters: Any, strict: bool, at: str) -> None:
    """A function's parameters: a JSON schema of an object (arguments are always an object); under
    `strict`, one OpenAI's strict rules can close (grammar.strict_schema refuses the others)."""
    if not isinstance(parameters, dict):
        raise BadRequest(f"{at} must be a JSON schema object, not {shown(parameters)}", at)
    kinds = parameters.get("type", "object")
    if kinds != "object" and not (isinstance(kinds, list) and "object" in kinds):
        raise BadRequest(f"{at} must describe an object (type \"object\"), not type {shown(kinds)}", at)
    if strict:
        strict_schema(parameters, at)


def tool_choice(value: Any, names: tuple[str, ...]) -> tuple[str, str | None]:
    """(choice, the function named or None) of `tool_choice`, given the tools' `names` (empty: no tools)."""
    if value is None:
        return ("auto" if names else "none"), None
    if isinstance(value, str):
        if value not in CHOICES:
            raise BadRequest(f"tool_choice must be one of {', '.join(CHOICES)} or a function, not {shown(value)}",
                             "tool_choice")
        if value == "required" and not names:
            raise BadRequest("tool_choice \"required\" needs tools; none were given", "tool_choice")
        return value, None
    if not isinstance(value, dict) or value.get("type") != "function" or not isinstance(value.get("function"), dict):
        raise BadRequest(f"tool_choice must be one of {', '.join(CHOICES)} or {{\"type\": \"function\", "
                         f"\"function\": {{\"name\": ...}}}}, not {shown(value)}", "tool_choice")
    unknown(value, TOOL_FIELDS, "tool_choice")
    unknown(value["function"], ("name",), "tool_choice.function")
    name = value["function"].get("name")
    if not names:
        raise BadRequest("tool_choice names a function but no tools were given", "tool_choice")
    if name not in names:
        raise BadRequest(f"tool_choice.function.name must name one of the tools, not {shown(name)}",
                         "tool_choice.function.name")
    return "function", name


def unknown(value: dict, known: tuple[str, ...], at: str) -> None:
    """BadRequest naming the first key of `value` not in `known`."""
    extra = [k for k in value if k not in known]
    if extra:
        raise BadRequest(f"{at}.{extra[0]}: unrecognized field", f"{at}.{extra[0]}")


# -- the history's calls and results


def carries_tools(m: Any) -> bool:
    """`m` is a history message `template_message` converts: a tool result, or an assistant's calls."""
    # An empty tool_calls (what an SDK echoes of a reply without calls) carries none.
    return isinstance(m, dict) and (m.get("role") == "tool" or (m.get("role") == "assistant"
                                                                 and m.get("tool_calls") not in (None, [])))


def template_message(m: dict, at: str) -> dict:
    """The chat template's dict for `m` (`carries_tools(m)`), the message at JSON path `at`: a tool result
    {"role": "tool", "content", "tool_call_id"}, or an assistant's {"role": "assistant", "content",
    "tool_calls"} with each call's arguments parsed. BadRequest naming the field at fault."""
    if m.get("role") == "tool":
        unknown(m, ("role", "content", "tool_call_id", "name"), at)
        call_id = m.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise BadRequest(f"{at}.tool_call_id must be the id of the call answered, not {shown(call_id)}",
                             f"{at}.tool_call_id")
        return {"role": "tool", "content": message_text(m.get("content"), f"{at}.content"), "tool_call_id": call_id}
    unknown(m, ("role", "content", "tool_calls", "name", *ECHOED_NULLS), at)
    for key in ECHOED_NULLS:
        if m.get(key) is not None:
            raise BadRequest(f"{at}.{key} must be null here, not {shown(m[key])}", f"{at}.{key}")
    calls = m.get("tool_calls")
    if not isinstance(calls, list) or not calls:
        raise BadRequest(f"{at}.tool_calls must be a non-empty array of calls, not {shown(calls)}",
                         f"{at}.tool_calls")
    content = m.get("content")
    # A null content (OpenAI's, beside calls) reads as "": templates concatenate it or test it for truth.
    text = "" if content is None else message_text(content, f"{at}.content")
    return {"role": "assistant", "content": text,
            "tool_calls": [history_call(c, f"{at}.tool_calls[{j}]") for j, c in enumerate(calls)]}


def history_call(call: Any, at: str) -> dict:
    """One of an assistant's calls, {id, type: "function", function: {name, arguments: JSON text}}, with
    `arguments` parsed."""
    if not isinstance(call, dict) or call.get("type", "function") != "function":
        raise BadRequest(f"{at} must be {{\"id\", \"type\": \"function\", \"function\"}}, not {shown(call)}", at)
    unknown(call, ("id", "type", "function"), at)
    call_id = call.get("id")
    if not isinstance(call_id, str) or not call_id:
        raise BadRequest(f"{at}.id must be a non-empty string, not {shown(call_id)}", f"{at}.id")
    function = call.get("function")
    if not isinstance(function, dict):
        raise BadRequest(f"{at}.function must be an object with name and arguments, not {shown(function)}",
                         f"{at}.function")
    unknown(function, ("name", "arguments"), f"{at}.function")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise BadRequest(f"{at}.function.name must be a non-empty string, not {shown(name)}", f"{at}.function.name")
    text = function.get("arguments")
    where = f"{at}.function.arguments"
    if not isinstance(text, str):
        raise BadRequest(f"{where} must be a string of JSON, not {shown(text)}", where)
    try:
        arguments = json.loads(text, parse_constant=refuse_constant)
    except ValueError as exc:  # JSONDecodeError, and NaN / Infinity
        raise BadRequest(f"{where} is not JSON: {one_line(exc)}", where) from None
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def refuse_constant(word: str) -> Any:
    """json.loads's hook for NaN and Infinity, which Python reads and JSON does not have."""
    raise json.JSONDecodeError(f"{word} is not JSON", word, 0)  # as json.loads says of any other non-JSON


def message_text(value: Any, at: str) -> str:
    """A message's text: a string, or an array of text parts joined by newlines (as OpenAI joins them)."""
    if isinstance(value, list) and value and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in value):
        value = "\n".join(p["text"] for p in value)
    if not isinstance(value, str):
        raise BadRequest(f"{at} must be a string or an array of text parts, not {shown(value)}", at)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # JSON's \ud800 escapes give lone surrogates, which no tokenizer encodes
        raise BadRequest(f"{at} holds a lone surrogate; it is not Unicode text", at) from None
    return value


# -- the model's calls


def detects(template_source: str) -> bool:
    """The chat template teaches the Hermes format this module reads (Qwen2.5, Qwen3, Hermes...)."""
    return OPEN in template_source


def new_call_id() -> str:
    """An OpenAI-style call id: "call_" and 24 random hex digits."""
    return "call_" + secrets.token_hex(12)


def read_call(inner: str, names: Collection[str] | None) -> dict | None:
    """The call a block's inner text writes, {"id", "type", "function": {"name", "arguments": compact JSON}};
    None when it is not one: not a JSON object, no name, a name not in `names` (when given), or arguments
    that are not an object (a string holding a JSON object is taken, as some models write it)."""
    try:
        data = json.loads(inner, parse_constant=refuse_constant)
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not data["name"]:
        return None
    if names is not None and data["name"] not in names:
        return None
    arguments = data.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments, parse_constant=refuse_constant)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    text = json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))
    return {"id": new_call_id(), "type": "function", "function": {"name": data["name"], "arguments": text}}


def partial_open(text: str) -> int:
    """The length of the longest end of `text` that `<tool_call>` starts with (a tag still being written)."""
    for k in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-k:]):
            return k
    return 0


class ToolCallReader:
    """Reads a sample's text as it comes (`feed`, then `finish` once): gives back the content, collects
    `calls`. `names`: the request's functions (a block naming another stays content); None takes any.

    The concatenation of every `feed`'s answer and `finish`'s is the content, however the text is split.
    """

    def __init__(self, names: Collection[str] | None = None):
        self.names = names
        self.calls: list[dict] = []
        self.reported = 0  # calls new_calls has handed out
        self.pending = ""  # text outside blocks not given out yet: whitespace, and a tag being written
        self.block: str | None = None  # inside a block: its text since `<tool_call>`
        self.space = ""  # the whitespace before the open block: dropped if it is a call, else content again
        self.scanned = 0  # no `</tool_call>` starts in the open block before this index (each byte searched once)
        self.after_call = False  # the last thing read was a call: whitespace now is a separator until text comes

    def feed(self, text: str) -> str:
        """Read `text`, the next piece of the sample; the content that is safe to give out now."""
        out: list[str] = []
        if self.block is not None:
            self.block += text
        else:
            self.pending += text
        while self.step(out):
            pass
        return "".join(out)

    def finish(self) -> str:
        """The sample ended: the rest of the content (a block never closed is content, tags and all)."""
        out = [self.feed("")]
        if self.block is not None:
            out.append(self.space + OPEN + self.block)
        elif not (self.after_call and not self.pending.strip()):
            out.append(self.pending)  # whitespace after a last call is a separator; anything else is content
        self.pending, self.block, self.space = "", None, ""
        return "".join(out)

    def new_calls(self) -> list[dict]:
        """The calls completed since the last time this was asked (a stream's deltas)."""
        fresh = self.calls[self.reported:]
        self.reported = len(self.calls)
        return fresh

    def step(self, out: list[str]) -> bool:
        """Move on as far as the text read allows, appending content to `out`; True while there is more to do."""
        if self.block is not None:
            return self.close_block(out)
        start = self.pending.find(OPEN)
        cut = start if start >= 0 else len(self.pending) - partial_open(self.pending)
        head = self.pending[:cut]
        body = head.rstrip()  # the whitespace before a (possible) block waits to see whether a block comes
        if body:
            out.append(body)
            self.after_call = False
        if start < 0:
            self.pending = self.pending[len(body):]
            return False
        self.space = head[len(body):]
        self.block, self.pending = self.pending[start + len(OPEN):], ""
        return True

    def close_block(self, out: list[str]) -> bool:
        """Inside a block: when its `</tool_call>` has come, a call (or, failing that, content)."""
        assert self.block is not None
        end = self.block.find(CLOSE, self.scanned)
        if end < 0:
            self.scanned = max(0, len(self.block) - len(CLOSE) + 1)
            return False
        inner, self.pending = self.block[:end], self.block[end + len(CLOSE):]
        call = read_call(inner, self.names)
        if call is None:
            out.append(self.space + OPEN + inner + CLOSE)
            self.after_call = False
        else:
            self.calls.append(call)
            self.after_call = True
        self.block, self.space, self.scanned = None, "", 0
        return True


# -- forcing calls


def tool_call_grammar(tools: Tools) -> str | None:
    """The llguidance grammar (Lark) a reply obeys under `tools`' choice: one call block of the named
    function, or, for "required", of any tool (one or more, newline-separated, when `parallel`); None
    for "none" and "auto". Each block's JSON is {"name": const, "arguments": the function's parameters
    (closed by OpenAI's strict rules when the function is strict), any object without them}. BadRequest
    naming the tool whose parameters llguidance cannot compile."""
    if tools.choice in ("none", "auto"):
        return None
    wanted = [d["function"] for d in tools.definitions
              if tools.choice == "required" or d["function"]["name"] == tools.function]
    schema = {"anyOf": [call_schema(f) for f in wanted], "x-guidance": COMPILE_OPTIONS}
    repeat = ' ("\\n" call)*' if tools.choice == "required" and tools.parallel else ""
    lark = "\n".join([
        f"start: call{repeat}",
        f'call: "{OPEN}\\n" body "\\n{CLOSE}"',
        f"body: %json {json.dumps(schema)}",
    ])
    problem = grammar_problem(lark)
    if problem is not None:
        param, reason = culprit(tools, problem)
        raise BadRequest(f"tool parameters llguidance cannot compile: {shorten(reason)}", param)
    return lark


@functools.lru_cache(maxsize=64)
def grammar_problem(lark: str) -> str | None:
    """What llguidance says is wrong with `lark` (None: nothing): once per grammar, not once per request
    of the same tools (kvlayout.grammar.Grammars.lark compiles it once too)."""
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(lark)
    return messages[0] if failed else None


def call_schema(function: dict) -> dict:
    """The JSON schema of one block calling `function`: its name, then its arguments."""
    parameters = function.get("parameters") or ANY_OBJECT
    if function.get("strict"):
        parameters = strict_schema(parameters)
    elif "type" not in parameters:
        parameters = {"type": "object", **parameters}  # arguments are an object whatever the schema leaves open
    return {"type": "object", "properties": {"name": {"const": function["name"]}, "arguments": parameters},
            "required": ["name", "arguments"], "additionalProperties": False}


def culprit(tools: Tools, reason: str) -> tuple[str, str]:
    """(param, llguidance's message) of the first tool whose parameters llguidance refuses on their own;
    ("tools", `reason`, the whole grammar's message) if none does."""
    for i, definition in enumerate(tools.definitions):
        parameters = definition["function"].get("parameters")
        if parameters is None:
            continue
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(parameters, defaults=COMPILE_OPTIONS)
        except ValueError as exc:
            return f"tools[{i}].function.parameters", str(exc)
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
        if failed:
            return f"tools[{i}].function.parameters", messages[0]
    return "tools", reason
