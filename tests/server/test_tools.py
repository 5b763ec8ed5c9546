"""OpenAI tool calling on a live server, through the official `openai` client and LangChain.

The model is a random Llama written by mlx-lm (vocabulary 49152) with SmolLM2's tokenizer.json and a
chat template reproducing the tool parts of Qwen2.5's (`<tool_call>` blocks): a model the server renders
tools for and reads calls from. Checked: tool_choice "required" and a named function (forced by a
grammar), parallel_tool_calls, a streamed call, "auto" and "none", a history holding calls and results,
the refusals, and LangChain's bind_tools / with_structured_output.

The oracles are independent of the server: a hand-written checker of the small strict schemas (their
keys exactly, the enums, the integer's range, JSON's types), which the random model, left free, never
satisfies; the prompt's token count against the template rendered here by jinja2 (as transformers'
apply_chat_template renders it: tools as the `tools` variable, a call's arguments as a parsed object)
and encoded by the `tokenizers` library; "auto"'s reply against the same prompt's ids sent to
/v1/completions; a streamed call against the same seeded request answered whole. Seeds and temperatures
are chosen so that the random model closes its calls (each forced test asserts finish "tool_calls").
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any, Literal

import jinja2.sandbox
import openai
import pydantic
import pytest
import tokenizers
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_openai import ChatOpenAI

from kvlayout.models.smollm2 import smollm2_dir
from tests.models.families import Checkpoint, write_checkpoint
from tests.server.conftest import serving

# Reproduces the tool parts of Qwen2.5's chat template (the tools in a system turn, an assistant's calls as
# <tool_call> blocks of `arguments | tojson`, tool results as <tool_response> in a user turn).
QWEN_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}{{- "\n" }}{{- tool | tojson }}{%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}{%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}{{- '\n' + message.content }}{%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}{{- tool_call.arguments | tojson }}{{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\n<tool_response>\n' }}{{- message.content }}{{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}{{- '<|im_end|>\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"""  # noqa: E501

LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
         "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "vocab_size": 49152,
         "rope_theta": 10000.0, "tie_word_embeddings": True, "max_position_embeddings": 4096, "eos_token_id": 2}
MAX_TOKENS = 400  # a forced call of the random model takes 50-100 tokens (it pads the JSON with whitespace)
CITIES, ZONES = ["Paris", "Oslo"], ["UTC", "CET"]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"enum": CITIES},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a zone", "strict": True,
    "parameters": {"type": "object", "properties": {"zone": {"enum": ZONES}, "exact": {"type": "boolean"}},
                   "required": ["zone", "exact"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "weather in Paris?"}]
CALL_ID = re.compile(r"call_[0-9a-f]{24}")


class GetWeather(pydantic.BaseModel):
    """The weather in a city."""

    city: Literal["Paris", "Oslo"]
    days: int = pydantic.Field(ge=1, le=7)


def valid_arguments(name: str, arguments: Any) -> bool:
    """The tool's schema, by hand: exactly its keys (in schema order), the enum, the integer's range, a boolean."""
    if not isinstance(arguments, dict):
        return False
    if name in ("get_weather", "GetWeather"):
        return (list(arguments) == ["city", "days"] and arguments["city"] in CITIES
                and type(arguments["days"]) is int and 1 <= arguments["days"] <= 7)
    if name == "get_time":
        return list(arguments) == ["zone", "exact"] and arguments["zone"] in ZONES and type(arguments["exact"]) is bool
    return False


def valid_call(call) -> bool:
    """An SDK tool call: an OpenAI id, a function call whose JSON arguments fit its tool's schema."""
    return (CALL_ID.fullmatch(call.id) is not None and call.type == "function"
            and valid_arguments(call.function.name, json.loads(call.function.arguments)))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A random Llama (mlx-lm's files), SmolLM2's tokenizer, Qwen2.5's tool template, <|im_end|> its end."""
    out = write_checkpoint(tmp_path_factory.mktemp("tool_model"), Checkpoint(LLAMA))
    shutil.copy(smollm2_dir(progress=lambda line: None) / "tokenizer.json", out / "tokenizer.json")
    (out / "chat_template.jinja").write_text(QWEN_TEMPLATE)
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    return out


@pytest.fixture(scope="module")
def server(model_dir):
    with serving(None, {"model": {"path": str(model_dir)}, "server": {"max_tokens": MAX_TOKENS}}) as live:
        yield live


def rendered_ids(model_dir: Path, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """The oracle's prompt: the template rendered by jinja2 as transformers renders it (its tojson: JSON
    without HTML escapes), encoded by the `tokenizers` library (the special tokens of the markup parsed)."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda value: json.dumps(value, ensure_ascii=False)
    text = env.from_string(QWEN_TEMPLATE).render(messages=messages, tools=tools, add_generation_prompt=True)
    return tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(text, add_special_tokens=False).ids


def chat(live, messages=ASK, **kw):
    return live.client().chat.completions.create(model=live.model, messages=messages, **kw)


@pytest.fixture(scope="module")
def forced_reply(server):
    """tool_choice "required" with one strict tool (seed 4 at temperature 0.5: one call, which closes)."""
    return chat(server, tools=[WEATHER], tool_choice="required", max_tokens=MAX_TOKENS, temperature=0.5, seed=4)


# -- forced calls


def test_required_gives_one_valid_call(forced_reply):
    choice = forced_reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert valid_call(call), call


def test_free_reply_is_no_call(server):
    """The checker is not vacuous: the same request left free (tool_choice "auto") writes no call."""
    answer = chat(server, tools=[WEATHER], max_tokens=40, temperature=0.5, seed=0)
    assert answer.choices[0].message.tool_calls is None
    assert answer.choices[0].finish_reason in ("stop", "length")


def test_named_function_is_the_one_called(server):
    answer = chat(server, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}},
                  max_tokens=MAX_TOKENS, temperature=0.5, seed=0)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [c.function.name for c in choice.message.tool_calls] == ["get_time"]
    assert valid_call(choice.message.tool_calls[0]), choice.message.tool_calls


def test_parallel_calls_allowed_or_not(server):
    """seed 1 at temperature 0.5: allowed, the model writes several calls; refused, the grammar ends at one."""
    answers = {parallel: chat(server, tools=[WEATHER], tool_choice="required", parallel_tool_calls=parallel,
                              max_tokens=MAX_TOKENS, temperature=0.5, seed=1) for parallel in (True, False)}
    several, one = answers[True].choices[0], answers[False].choices[0]
    assert several.finish_reason == one.finish_reason == "tool_calls"
    assert len(several.message.tool_calls) > 1 and len(one.message.tool_calls) == 1
    calls = several.message.tool_calls + one.message.tool_calls
    assert all(valid_call(c) for c in calls), calls
    assert len({c.id for c in calls}) == len(calls)


def test_streamed_call_joins_to_the_whole_call(server):
    request = {"tools": [WEATHER, TIME], "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
               "max_tokens": MAX_TOKENS, "temperature": 1.0, "seed": 3}
    whole = chat(server, **request).choices[0]
    joined: dict[int, dict] = {}
    finishes, contents = [], []
    for chunk in chat(server, stream=True, **request):
        for choice in chunk.choices:
            finishes += [choice.finish_reason] if choice.finish_reason else []
            contents += [choice.delta.content] if choice.delta.content else []
            for delta in choice.delta.tool_calls or ():
                call = joined.setdefault(delta.index, {"id": "", "type": "", "name": "", "arguments": ""})
                call["id"] += delta.id or ""
                call["type"] += delta.type or ""
                if delta.function is not None:
                    call["name"] += delta.function.name or ""
                    call["arguments"] += delta.function.arguments or ""
    assert whole.finish_reason == "tool_calls" and finishes == ["tool_calls"] and contents == []
    [expected] = whole.message.tool_calls
    assert list(joined) == [0] and CALL_ID.fullmatch(joined[0]["id"])
    assert (joined[0]["type"], joined[0]["name"], joined[0]["arguments"]) == (
        "function", expected.function.name, expected.function.arguments)
    assert valid_call(expected)


# -- the prompt the tools make


def test_auto_renders_the_tools_into_the_prompt(server, model_dir):
    answer = chat(server, tools=[WEATHER, TIME], tool_choice="auto", max_tokens=6, temperature=0)
    ids = rendered_ids(model_dir, ASK, [WEATHER, TIME])
    assert answer.usage.prompt_tokens == len(ids)
    # The reply is the model's continuation of exactly those ids (the same greedy tokens as a text completion).
    text = server.client().completions.create(model=server.model, prompt=ids, max_tokens=6, temperature=0)
    assert answer.choices[0].message.tool_calls is None
    assert answer.choices[0].message.content == text.choices[0].text


def test_none_leaves_the_tools_out(server, model_dir):
    without = chat(server, max_tokens=1)
    none = chat(server, tools=[WEATHER], tool_choice="none", max_tokens=1)
    assert none.usage.prompt_tokens == without.usage.prompt_tokens == len(rendered_ids(model_dir, ASK))
    assert len(rendered_ids(model_dir, ASK, [WEATHER])) > none.usage.prompt_tokens


def test_history_with_calls_and_results(server, model_dir, forced_reply):
    message = forced_reply.choices[0].message
    [call] = message.tool_calls
    history = [*ASK, message.model_dump(), {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21C"}]
    answer = chat(server, messages=history, tools=[WEATHER], max_tokens=1)
    parsed = {"name": call.function.name, "arguments": json.loads(call.function.arguments)}
    oracle = [*ASK, {"role": "assistant", "content": None, "tool_calls": [{"id": call.id, "type": "function",
                                                                          "function": parsed}]},
              {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21C"}]
    assert answer.usage.prompt_tokens == len(rendered_ids(model_dir, oracle, [WEATHER]))


def test_history_with_arguments_not_json_is_refused(server):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{city: Paris"}}
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    with pytest.raises(openai.BadRequestError) as refused:
        chat(server, messages=history, tools=[WEATHER], max_tokens=1)
    assert refused.value.status_code == 400
    assert refused.value.param == "messages[1].tool_calls[0].function.arguments"


# -- refusals


def test_model_without_tool_template_refuses_tools(live):
    """The tiny preset has no chat template: tools are a 400 naming "tools"."""
    with pytest.raises(openai.BadRequestError) as refused:
        chat(live, tools=[WEATHER], max_tokens=1)
    assert refused.value.param == "tools"


@pytest.mark.parametrize(("request_fields", "param"), [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
     "tool_choice.function.name"),
])
def test_contradictory_tool_fields_are_refused(server, request_fields, param):
    with pytest.raises(openai.BadRequestError) as refused:
        chat(server, max_tokens=1, **request_fields)
    assert refused.value.param == param


# -- LangChain


def lang_chain(live) -> ChatOpenAI:
    return ChatOpenAI(base_url=f"{live.url}/v1", api_key="x", model=live.model, temperature=1.0,
                      max_tokens=MAX_TOKENS, max_retries=0, seed=3)


def test_langchain_bind_tools_and_round_trip(server, model_dir):
    llm = lang_chain(server)
    asked = [HumanMessage("weather in Paris?")]
    reply = llm.bind_tools([GetWeather], tool_choice="GetWeather", strict=True).invoke(asked)
    assert isinstance(reply, AIMessage) and reply.response_metadata["finish_reason"] == "tool_calls"
    [call] = reply.tool_calls
    assert call["name"] == "GetWeather" and valid_arguments("GetWeather", call["args"]), call
    assert CALL_ID.fullmatch(call["id"])
    history = [*asked, reply, ToolMessage(content="sunny, 21C", tool_call_id=call["id"])]
    again = llm.bind_tools([GetWeather], tool_choice="none").invoke(history, max_tokens=3)
    assert isinstance(again, AIMessage) and not again.tool_calls
    # "none": the tools stay out of the prompt; the history's call is rendered as the template writes it.
    called = {"id": call["id"], "type": "function", "function": {"name": "GetWeather", "arguments": call["args"]}}
    oracle = [{"role": "user", "content": "weather in Paris?"},
              {"role": "assistant", "content": None, "tool_calls": [called]},
              {"role": "tool", "tool_call_id": call["id"], "content": "sunny, 21C"}]
    assert again.usage_metadata["input_tokens"] == len(rendered_ids(model_dir, oracle))


def test_langchain_structured_output_by_function_calling(server):
    structured = lang_chain(server).with_structured_output(GetWeather, method="function_calling", strict=True)
    value = structured.invoke("weather?")
    assert isinstance(value, GetWeather) and valid_arguments("GetWeather", value.model_dump()), value
