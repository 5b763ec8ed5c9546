"""server.tools without an engine: the checks of tools and tool_choice, the history's calls, the reader of
the model's Hermes-format calls, and the grammar that forces calls (walked through llguidance byte by byte)."""

from __future__ import annotations

import json
import re

import llguidance
import pytest

from kvlayout.errors import BadRequest
from kvlayout.grammar import ByteVocabulary
from kvlayout.server.tools import (
    ToolCallReader,
    Tools,
    carries_tools,
    detects,
    parse_tools,
    template_message,
    tool_call_grammar,
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather } in \" a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
NOW = {"type": "function", "function": {"name": "now"}}


def tool(name: str, **function) -> dict:
    return {"type": "function", "function": {"name": name, **function}}


def refusal(call, *args) -> BadRequest:
    with pytest.raises(BadRequest) as caught:
        call(*args)
    assert caught.value.status == 400 and "\n" not in caught.value.message
    return caught.value


# -- parse_tools


def test_no_tools_is_none_and_a_plain_choice_is_allowed():
    assert parse_tools({}) is None
    assert parse_tools({"tools": None, "tool_choice": "none", "parallel_tool_calls": False}) is None
    assert parse_tools({"tool_choice": "auto"}) is None


def test_tools_as_given_with_defaults():
    tools = parse_tools({"tools": [WEATHER, NOW]})
    assert tools == Tools((WEATHER, NOW), "auto", None, True)
    assert tools.names == ("get_weather", "now") and tools.calls_allowed
    assert parse_tools({"tools": [NOW], "tool_choice": "none"}).calls_allowed is False


def test_named_choice_and_parallel():
    body = {"tools": [WEATHER, NOW], "tool_choice": {"type": "function", "function": {"name": "now"}},
            "parallel_tool_calls": False}
    assert parse_tools(body) == Tools((WEATHER, NOW), "function", "now", False)
    assert parse_tools({"tools": [NOW], "tool_choice": "required"}).choice == "required"


@pytest.mark.parametrize("body, param", [
    ({"tools": []}, "tools"),
    ({"tools": {"type": "function"}}, "tools"),
    ({"tools": [tool(f"f{i}") for i in range(129)]}, "tools"),
    ({"tools": [NOW, "now"]}, "tools[1]"),
    ({"tools": [{"type": "custom", "function": {"name": "x"}}]}, "tools[0]"),
    ({"tools": [{**NOW, "extra": 1}]}, "tools[0].extra"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": [tool("a b")]}, "tools[0].function.name"),
    ({"tools": [tool("x" * 65)]}, "tools[0].function.name"),
    ({"tools": [tool("")]}, "tools[0].function.name"),
    ({"tools": [NOW, tool("ok", description=3)]}, "tools[1].function.description"),
    ({"tools": [tool("ok", strict="yes")]}, "tools[0].function.strict"),
    ({"tools": [tool("ok", parameters=[])]}, "tools[0].function.parameters"),
    ({"tools": [tool("ok", parameters={"type": "string"})]}, "tools[0].function.parameters"),
    ({"tools": [tool("ok", parameters={"type": "object", "additionalProperties": True}, strict=True)]},
     "tools[0].function.parameters"),
    ({"tools": [tool("ok", returns={})]}, "tools[0].function.returns"),
    ({"tools": [NOW, tool("a"), tool("now")]}, "tools[2].function.name"),
    ({"tools": [NOW], "tool_choice": "always"}, "tool_choice"),
    ({"tools": [NOW], "tool_choice": {"type": "function", "function": {"name": "later"}}},
     "tool_choice.function.name"),
    ({"tools": [NOW], "tool_choice": {"type": "function", "function": {"name": "now", "x": 1}}},
     "tool_choice.function.x"),
    ({"tools": [NOW], "tool_choice": {"type": "function", "name": "now"}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "now"}}}, "tool_choice"),
    ({"tools": [NOW], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"parallel_tool_calls": 1}, "parallel_tool_calls"),
])
def test_each_refusal_names_its_param(body, param):
    assert refusal(parse_tools, body).param == param


def test_a_strict_schema_that_can_be_closed_is_taken():
    closed = tool("ok", parameters={"type": "object", "properties": {"a": {"type": "string"}}}, strict=True)
    assert parse_tools({"tools": [closed]}).definitions == (closed,)


# -- the history


CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def test_assistant_calls_get_parsed_arguments():
    m = {"role": "assistant", "content": None, "tool_calls": [CALL, {**CALL, "id": "call_2", "function": {
        "name": "now", "arguments": "{}"}}], "refusal": None}
    assert carries_tools(m)
    assert template_message(m, "messages[1]") == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": {}}}]}


def test_tool_result_message():
    m = {"role": "tool", "content": [{"type": "text", "text": "18C"}, {"type": "text", "text": "sunny"}],
         "tool_call_id": "call_1"}
    assert carries_tools(m)
    assert template_message(m, "messages[2]") == {"role": "tool", "content": "18C\nsunny", "tool_call_id": "call_1"}


def test_plain_messages_are_left_to_the_caller():
    assert not carries_tools({"role": "assistant", "content": "hi"})
    assert not carries_tools({"role": "user", "content": "hi"})


@pytest.mark.parametrize("message, param", [
    ({"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "{city: 1}"}}]},
     "messages[3].tool_calls[0].function.arguments"),
    ({"role": "assistant", "tool_calls": [CALL, {**CALL, "function": {"name": "f", "arguments": "NaN"}}]},
     "messages[3].tool_calls[1].function.arguments"),
    ({"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f", "arguments": {"a": 1}}}]},
     "messages[3].tool_calls[0].function.arguments"),
    ({"role": "assistant", "tool_calls": [{**CALL, "function": {"arguments": "{}"}}]},
     "messages[3].tool_calls[0].function.name"),
    ({"role": "assistant", "tool_calls": [{**CALL, "id": 7}]}, "messages[3].tool_calls[0].id"),
    ({"role": "assistant", "tool_calls": [{**CALL, "type": "custom"}]}, "messages[3].tool_calls[0]"),
    ({"role": "assistant", "tool_calls": [{**CALL, "function": "f"}]}, "messages[3].tool_calls[0].function"),
    ({"role": "assistant", "tool_calls": []}, "messages[3].tool_calls"),
    ({"role": "assistant", "tool_calls": [CALL], "content": 5}, "messages[3].content"),
    ({"role": "assistant", "tool_calls": [CALL], "refusal": "no"}, "messages[3].refusal"),
    ({"role": "assistant", "tool_calls": [CALL], "mood": 1}, "messages[3].mood"),
    ({"role": "tool", "content": "18C"}, "messages[3].tool_call_id"),
    ({"role": "tool", "content": None, "tool_call_id": "c"}, "messages[3].content"),
    ({"role": "tool", "content": "\ud800", "tool_call_id": "c"}, "messages[3].content"),
])
def test_history_refusals_name_the_field(message, param):
    assert refusal(template_message, message, "messages[3]").param == param


# -- the reader


def read_whole(text: str, names=None) -> tuple[str, list[dict]]:
    reader = ToolCallReader(names)
    content = reader.feed(text) + reader.finish()
    return content, reader.calls


def read_split(text: str, cuts: list[int], names=None) -> tuple[str, list[dict], list[str]]:
    reader = ToolCallReader(names)
    pieces, edges = [], [0, *cuts, len(text)]
    for a, b in zip(edges, edges[1:], strict=False):
        pieces.append(reader.feed(text[a:b]))
    pieces.append(reader.finish())
    return "".join(pieces), reader.calls, pieces


def without_ids(calls: list[dict]) -> list[dict]:
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", c["id"]) and c["type"] == "function" for c in calls)
    return [c["function"] for c in calls]


BLOCK_WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
BLOCK_NOW = '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
FN_WEATHER = {"name": "get_weather", "arguments": '{"city":"Paris","days":2}'}
FN_NOW = {"name": "now", "arguments": "{}"}

# (text, the content expected, the calls expected): hand-written.
CASES = [
    ("Just text, no <tool call> here.", "Just text, no <tool call> here.", []),
    (BLOCK_WEATHER, "", [FN_WEATHER]),
    (BLOCK_WEATHER + "\n" + BLOCK_NOW + "\n", "", [FN_WEATHER, FN_NOW]),
    ("Let me check.\n" + BLOCK_WEATHER, "Let me check.", [FN_WEATHER]),
    ("A\n" + BLOCK_NOW + "\nB <tool", "A\nB <tool", [FN_NOW]),
    ("ends in space  \n", "ends in space  \n", []),
    ("<tool_call>\n{not json}\n</tool_call>", "<tool_call>\n{not json}\n</tool_call>", []),
    ("x <tool_call>\n{\"arguments\": {}}\n</tool_call>" + BLOCK_NOW,
     "x <tool_call>\n{\"arguments\": {}}\n</tool_call>", [FN_NOW]),
    (BLOCK_NOW + "\n<tool_call>[1]</tool_call>", "\n<tool_call>[1]</tool_call>", [FN_NOW]),
    ("cut short " + BLOCK_NOW[:30], "cut short " + BLOCK_NOW[:30], []),
    ('<tool_call>{"name": "f", "arguments": "{\\"a\\": [1, 2]}"}</tool_call>', "",
     [{"name": "f", "arguments": '{"a":[1,2]}'}]),
    ('<tool_call>{"name": "f", "arguments": 3}</tool_call>', '<tool_call>{"name": "f", "arguments": 3}</tool_call>',
     []),
    ('<tool_call>{"name": "f"}</tool_call>é', "é", [{"name": "f", "arguments": "{}"}]),
]


@pytest.mark.parametrize("text, content, calls", CASES)
def test_reader_whole(text, content, calls):
    got_content, got_calls = read_whole(text)
    assert got_content == content
    assert without_ids(got_calls) == calls


@pytest.mark.parametrize("text, content, calls", CASES)
def test_reader_split_anywhere(text, content, calls):
    for cut in range(len(text) + 1):
        got_content, got_calls, _ = read_split(text, [cut])
        assert (got_content, without_ids(got_calls)) == (content, calls), cut
    for step in (1, 2, 3, 7):
        got_content, got_calls, _ = read_split(text, list(range(step, len(text), step)))
        assert (got_content, without_ids(got_calls)) == (content, calls), step


def test_reader_streams_text_before_a_tag_and_holds_a_partial_tag():
    reader = ToolCallReader()
    assert reader.feed("Hello wor") == "Hello wor"
    assert reader.feed("ld <tool_") == "ld"  # the space and the tag's start wait
    assert reader.feed("call>\n{\"name\": \"now\"") == ""
    assert reader.new_calls() == []
    assert reader.feed("}\n</tool_call>") == ""
    first = reader.new_calls()
    assert without_ids(first) == [FN_NOW] and reader.new_calls() == []
    assert reader.feed("\n" + BLOCK_WEATHER) == ""
    assert without_ids(reader.new_calls()) == [FN_WEATHER]
    assert reader.finish() == ""
    assert len(reader.calls) == 2


def test_reader_keeps_a_call_to_an_unknown_name_as_content():
    text = "a" + BLOCK_NOW + BLOCK_WEATHER
    content, calls = read_whole(text, names={"get_weather"})
    assert content == "a" + BLOCK_NOW
    assert without_ids(calls) == [FN_WEATHER]


def test_call_ids_are_unique():
    _, calls = read_whole("\n".join([BLOCK_NOW] * 200))
    assert len(calls) == 200 and len({c["id"] for c in calls}) == 200


def test_arguments_are_compact_json_of_the_object_written():
    _, calls = read_whole('<tool_call>\n{"name": "f", "arguments": {"q": "Zürich", "n": [1, {"x": null}]}}\n'
                          '</tool_call>')
    assert calls[0]["function"]["arguments"] == '{"q":"Zürich","n":[1,{"x":null}]}'
    assert json.loads(calls[0]["function"]["arguments"]) == {"q": "Zürich", "n": [1, {"x": None}]}


def test_detects_the_hermes_format():
    assert detects("{%- for tool in tools %}...<tool_call>\\n{\"name\": <function-name>...</tool_call>")
    assert not detects("{% for message in messages %}{{ message.content }}{% endfor %}")


# -- the grammar


@pytest.fixture(scope="module")
def byte_tokenizer() -> llguidance.LLTokenizer:
    """llguidance over bytes: id b is byte b, id 256 the end of text."""
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(ByteVocabulary(257, 256)))


def accepts(grammar: str, tokenizer: llguidance.LLTokenizer, text: str) -> bool:
    assert llguidance.LLMatcher.validate_grammar_with_warnings(grammar)[0] is False
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    return matcher.consume_tokens(tokenizer.tokenize_str(text)) and matcher.is_accepting()


def grammar_for(**body) -> str:
    grammar = tool_call_grammar(parse_tools({"tools": [WEATHER, NOW], **body}))
    assert grammar is not None
    return grammar


def test_no_grammar_for_none_and_auto():
    assert tool_call_grammar(parse_tools({"tools": [NOW]})) is None
    assert tool_call_grammar(parse_tools({"tools": [NOW], "tool_choice": "none"})) is None


def test_named_grammar_takes_one_call_of_that_function(byte_tokenizer):
    grammar = grammar_for(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert accepts(grammar, byte_tokenizer, BLOCK_WEATHER)
    assert accepts(grammar, byte_tokenizer, '<tool_call>\n{"name":"get_weather","arguments":{"city":"Oslo"}}\n'
                                            '</tool_call>')
    assert not accepts(grammar, byte_tokenizer, BLOCK_NOW)  # another function
    assert not accepts(grammar, byte_tokenizer, BLOCK_WEATHER + "\n" + BLOCK_WEATHER)  # one call only
    assert not accepts(grammar, byte_tokenizer, BLOCK_WEATHER[:-1])  # unclosed
    assert not accepts(grammar, byte_tokenizer, "Sure. " + BLOCK_WEATHER)  # text first
    bad_arguments = ['{"city": 3}', '{"days": 2}', '{"city": "Oslo", "days": "two"}', '[]']
    for arguments in bad_arguments:
        text = f'<tool_call>\n{{"name": "get_weather", "arguments": {arguments}}}\n</tool_call>'
        assert not accepts(grammar, byte_tokenizer, text), arguments


def test_required_grammar_takes_any_tool_and_several_when_parallel(byte_tokenizer):
    parallel = grammar_for(tool_choice="required")
    assert accepts(parallel, byte_tokenizer, BLOCK_NOW)
    assert accepts(parallel, byte_tokenizer, BLOCK_WEATHER + "\n" + BLOCK_NOW)
    assert not accepts(parallel, byte_tokenizer, BLOCK_WEATHER + BLOCK_NOW)  # separated by a newline
    assert not accepts(parallel, byte_tokenizer, BLOCK_NOW.replace('"now"', '"later"'))
    assert not accepts(parallel, byte_tokenizer, "")
    single = grammar_for(tool_choice="required", parallel_tool_calls=False)
    assert accepts(single, byte_tokenizer, BLOCK_WEATHER)
    assert not accepts(single, byte_tokenizer, BLOCK_WEATHER + "\n" + BLOCK_NOW)


def test_strict_function_arguments_are_closed(byte_tokenizer):
    strict = tool("s", parameters={"type": "object", "properties": {"a": {"type": "integer"}}}, strict=True)
    loose = tool("s", parameters={"type": "object", "properties": {"a": {"type": "integer"}}})
    extra = '<tool_call>\n{"name": "s", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    plain = '<tool_call>\n{"name": "s", "arguments": {"a": 1}}\n</tool_call>'
    strict_grammar = tool_call_grammar(parse_tools({"tools": [strict], "tool_choice": "required"}))
    loose_grammar = tool_call_grammar(parse_tools({"tools": [loose], "tool_choice": "required"}))
    assert accepts(strict_grammar, byte_tokenizer, plain) and not accepts(strict_grammar, byte_tokenizer, extra)
    assert accepts(loose_grammar, byte_tokenizer, extra)


def test_grammar_output_reads_back_as_the_call(byte_tokenizer):
    grammar = grammar_for(tool_choice="required")
    text = BLOCK_WEATHER + "\n" + BLOCK_NOW
    assert accepts(grammar, byte_tokenizer, text)
    assert read_whole(text)[0] == "" and without_ids(read_whole(text)[1]) == [FN_WEATHER, FN_NOW]


def test_parameters_llguidance_cannot_compile_name_the_tool():
    broken = tool("b", parameters={"type": "object", "properties": {"x": {"type": "strin"}}})
    tools = parse_tools({"tools": [NOW, broken], "tool_choice": "required"})
    error = refusal(tool_call_grammar, tools)
    assert error.param == "tools[1].function.parameters" and "strin" in error.message
