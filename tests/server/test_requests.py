"""Request bodies checked field by field: what is accepted, and each refusal naming its field."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlayout.errors import BadRequest
from kvlayout.models.tokenizer import ByteTokenizer
from kvlayout.server.requests import Limits, parse_chat, parse_completion

LIMITS = Limits(model_id="m", capacity=100, max_tokens=50, max_n=4, vocab_size=258, temperature=0.0, top_p=1.0, seed=7)
TOK = ByteTokenizer()


def text(**body):
    return parse_completion({"model": "m", "prompt": "hi", **body}, LIMITS, TOK)


def chat(**body):
    return parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}, LIMITS, TOK, True)


def refused(parse, **body) -> BadRequest:
    with pytest.raises(BadRequest) as info:
        parse(**body)
    return info.value


def test_a_text_prompt_is_encoded_and_the_defaults_come_from_the_limits():
    order = text()
    assert order.prompt == [104, 105]  # the byte tokenizer: "h", "i"
    assert (order.n, order.temperature, order.top_p, order.seed, order.stream, order.include_usage) == (
        1, 0.0, 1.0, 7, False, False
    )
    # No max_tokens: the server's limit, within the room the prompt leaves (100 - 2 cells).
    assert order.max_tokens == 50
    assert not order.seeded


def test_token_ids_and_a_batch_of_one_are_prompts_too():
    assert text(prompt=[1, 2, 3]).prompt == [1, 2, 3]
    assert text(prompt=["ab"]).prompt == [97, 98]
    assert text(prompt=[[5, 6]]).prompt == [5, 6]


def test_a_chat_without_a_template_is_its_contents_joined_with_blank_lines():
    order = parse_chat({"model": "m", "messages": [{"role": "system", "content": "a"}, {"role": "user", "content": [
        {"type": "text", "text": "b"}, {"type": "text", "text": "c"}]}]}, LIMITS, TOK, True)
    assert bytes(order.prompt).decode() == "a\n\nb\nc"


def test_the_request_overrides_sampling_and_limits():
    order = chat(max_completion_tokens=10, temperature=0.5, top_p=0.9, seed=3, n=2, stop="x", stream=True,
                 stream_options={"include_usage": True})
    assert (order.max_tokens, order.temperature, order.top_p, order.seed, order.n) == (10, 0.5, 0.9, 3, 2)
    assert order.stop == ("x",) and order.stream and order.include_usage and order.seeded


def test_max_tokens_by_default_shrinks_to_the_room_the_prompt_leaves():
    assert text(prompt="x" * 90).max_tokens == 10
    assert text(prompt="x" * 90, n=2).max_tokens == 5


def test_an_assistant_message_an_sdk_echoes_with_empty_tool_calls_is_plain_history():
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello", "tool_calls": [], "refusal": None, "annotations": []},
                {"role": "user", "content": "again"}]
    plain = [{"role": m["role"], "content": m["content"]} for m in messages]
    assert chat(messages=messages).prompt == chat(messages=plain).prompt


def test_fields_asking_for_nothing_are_accepted():
    text(presence_penalty=0, frequency_penalty=0.0, logprobs=False, user="u", echo=False, best_of=1, logit_bias=None)
    chat(response_format={"type": "text"}, tool_choice="none", store=False, metadata={"a": "b"})


@pytest.mark.parametrize(
    "parse, body, param, status",
    [
        (text, {"model": 3}, "model", 400),
        (text, {"model": "other"}, "model", 404),
        (text, {"prompt": ""}, "prompt", 400),
        (text, {"prompt": []}, "prompt", 400),
        (text, {"prompt": ["a", "b"]}, "prompt", 400),
        (text, {"prompt": [1, "a"]}, "prompt", 400),
        (text, {"prompt": [300]}, "prompt", 400),
        (text, {"prompt": [-1]}, "prompt", 400),
        (text, {"prompt": {"a": 1}}, "prompt", 400),
        (text, {"max_tokens": 51}, "max_tokens", 400),
        (text, {"max_tokens": 0}, "max_tokens", 400),
        (text, {"max_tokens": "5"}, "max_tokens", 400),
        (text, {"max_tokens": True}, "max_tokens", 400),
        (text, {"max_tokens": 2.5}, "max_tokens", 400),
        (text, {"prompt": "x" * 80, "max_tokens": 21}, "max_tokens", 400),
        (text, {"prompt": "x" * 100}, "prompt", 400),
        (text, {"temperature": -0.1}, "temperature", 400),
        (text, {"temperature": 2.5}, "temperature", 400),
        (text, {"temperature": "hot"}, "temperature", 400),
        (text, {"top_p": 0}, "top_p", 400),
        (text, {"top_p": 1.5}, "top_p", 400),
        (text, {"seed": -1}, "seed", 400),
        (text, {"seed": 2**64}, "seed", 400),
        (text, {"n": 0}, "n", 400),
        (text, {"n": 5}, "n", 400),
        (text, {"stop": ""}, "stop", 400),
        (text, {"stop": ["a", 1]}, "stop", 400),
        (text, {"stop": ["a", "b", "c", "d", "e"]}, "stop", 400),
        (text, {"stream": "yes"}, "stream", 400),
        (text, {"stream_options": {"include_usage": True}}, "stream_options", 400),
        (text, {"stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage", 400),
        (text, {"stream": True, "stream_options": {"other": True}}, "stream_options", 400),
        (text, {"presence_penalty": 2.5}, "presence_penalty", 400),
        (text, {"frequency_penalty": "1"}, "frequency_penalty", 400),
        (text, {"logprobs": 21}, "logprobs", 400),
        (text, {"logprobs": True}, "logprobs", 400),
        (text, {"logit_bias": {"300": 1}}, "logit_bias.300", 400),
        (text, {"logit_bias": {"a": 1}}, "logit_bias.a", 400),
        (text, {"logit_bias": {"5": 101}}, "logit_bias.5", 400),
        (text, {"logit_bias": [5]}, "logit_bias", 400),
        (chat, {"logprobs": 1}, "logprobs", 400),
        (chat, {"top_logprobs": 2}, "top_logprobs", 400),
        (chat, {"logprobs": True, "top_logprobs": 21}, "top_logprobs", 400),
        (chat, {"response_format": {"type": "yaml"}}, "response_format", 400),
        (chat, {"response_format": {"type": "text", "x": 1}}, "response_format.x", 400),
        (text, {"user": 5}, "user", 400),
        (text, {"wat": 1}, "wat", 400),
        (text, {"messages": []}, "messages", 400),  # a chat field on the text endpoint
        (chat, {"messages": []}, "messages", 400),
        (chat, {"messages": "hi"}, "messages", 400),
        (chat, {"messages": [5]}, "messages[0]", 400),
        (chat, {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", 400),
        (chat, {"messages": [{"role": "user"}]}, "messages[0].content", 400),
        (chat, {"messages": [{"role": "user", "content": 5}]}, "messages[0].content", 400),
        (chat, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]", 400),
        (chat, {"messages": [{"role": "user", "content": "x", "tool_calls": [{}]}]}, "messages[0].tool_calls", 400),
        (chat, {"messages": [{"role": "user", "content": "x", "name": 5}]}, "messages[0].name", 400),
        (text, {"temperature": 10**400}, "temperature", 400),
        (text, {"top_p": -(10**400)}, "top_p", 400),
        (text, {"max_tokens": 1e20}, "max_tokens", 400),
        (chat, {"max_tokens": 5, "max_completion_tokens": 5}, "max_completion_tokens", 400),
        (chat, {"max_completion_tokens": 99}, "max_completion_tokens", 400),
        (chat, {"prompt": "x"}, "prompt", 400),  # a text field on the chat endpoint
        (chat, {"tools": [{"type": "function"}]}, "tools[0].function", 400),
        (chat, {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", 400),  # no template: no tools
    ],
)
def test_a_bad_field_is_refused_naming_it(parse, body, param, status):
    exc = refused(parse, **body)
    assert (exc.param, exc.status) == (param, status), exc.message
    assert param.split("[")[0].split(".")[0] in exc.message


def test_a_body_that_is_not_an_object_is_refused():
    for body in ([], "x", 3, None):
        with pytest.raises(BadRequest) as info:
            parse_completion(body, LIMITS, TOK)
        assert info.value.status == 400 and "JSON object" in info.value.message


def test_an_unknown_model_names_the_served_one():
    exc = refused(text, model="gpt-4")
    assert exc.code == "model_not_found" and "'m'" in exc.message


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "n",
          "stop", "stream", "stream_options", "logprobs", "user", "presence_penalty", "role", "content"]


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=6), st.booleans())
def test_any_json_body_is_an_order_or_a_bad_request_never_another_exception(body, as_chat):
    body = {"model": "m", **body}
    try:
        if as_chat:
            order = parse_chat(body, LIMITS, TOK, True)
        else:
            order = parse_completion(body, LIMITS, TOK)
    except BadRequest as exc:
        assert exc.status in (400, 404) and exc.message
        return
    # Accepted: within every limit.
    assert order.prompt and all(0 <= t < LIMITS.vocab_size for t in order.prompt)
    assert 1 <= order.n <= LIMITS.max_n and 1 <= order.max_tokens <= LIMITS.max_tokens
    assert len(order.prompt) + order.n * order.max_tokens <= LIMITS.capacity


def test_a_chat_a_template_cannot_take_is_refused_naming_messages_not_the_run_config():
    from kvlayout.models.chat import ChatTemplate

    class Templated(ByteTokenizer):
        chat_template = ChatTemplate("{{ raise_exception('no system role') }}", {}, "tokenizer_config.json")

    exc = refused(lambda **b: parse_chat({"model": "m", "messages": [{"role": "system", "content": "x"}], **b},
                                         LIMITS, Templated(), False))
    assert exc.param == "messages" and "requests[" not in exc.message and "no system role" in exc.message
    exc = refused(lambda **b: parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}], **b},
                                         LIMITS, TOK, False))
    assert "requests[" not in exc.message and "/v1/completions" in exc.message
