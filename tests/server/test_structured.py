"""Structured output through the official `openai` client and LangChain: chat's `response_format`
(`json_object`, `json_schema` strict) on the tiny preset's server (random weights, the byte tokenizer),
sampled, streamed, batched beside free requests; and the refusals of formats that cannot be honoured.

The oracles are independent of the server: Python's `json.loads` and a hand-written checker of the
small closed schema (its keys exactly, in JSON's types, the enum, the integer's range), which the
random model, left free, would never satisfy; for free requests batched beside constrained ones, the
same greedy requests sent alone. A choice that ends "length" is not a whole answer and is not parsed;
each sampled test asserts at least one "stop" (its seeds are chosen so: the random model writes short
objects for them, and a broken grammar would give unparsable ones).
"""

from __future__ import annotations

import json
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import openai
import pydantic
import pytest
from langchain_openai import ChatOpenAI  # a test extra (LangChain on the openai client): never skipped

MAX_TOKENS = 200
COLORS = ["red", "green", "blue"]
SCHEMA = {
    "title": "Verdict",
    "type": "object",
    "properties": {
        "color": {"type": "string", "enum": COLORS},
        "ok": {"type": "boolean"},
        "count": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["color", "ok", "count"],
    "additionalProperties": False,
}
# Strict mode on the schema with neither `required` nor `additionalProperties`: OpenAI's rules close the object
# and require every property (kvlayout.grammar), so an answer must hold exactly the three keys.
LOOSE = {k: v for k, v in SCHEMA.items() if k in ("type", "properties")}
STRICT = {"type": "json_schema", "json_schema": {"name": "verdict", "strict": True, "schema": LOOSE}}
FREE_PROMPTS = ["The cat sat on", "Once upon a time", "KV caches hold", "Tokens per second:"]


class Verdict(pydantic.BaseModel):
    color: Literal["red", "green", "blue"]
    ok: bool


def valid_verdict(value: Any) -> bool:
    """SCHEMA's rules, by hand: exactly its keys, a color of the enum, a JSON boolean, an integer in 0..9."""
    return (isinstance(value, dict) and list(value) == ["color", "ok", "count"]  # properties in schema order
            and value["color"] in COLORS and type(value["ok"]) is bool
            and type(value["count"]) is int and 0 <= value["count"] <= 9)


def ask(live, content: str = "Give a verdict.", **kw):
    return live.client().chat.completions.create(model=live.model, messages=[{"role": "user", "content": content}],
                                                 **kw)


def stopped(answer) -> list[str]:
    """The contents of the choices that ended "stop"; every other choice ended "length"."""
    assert all(c.finish_reason in ("stop", "length") for c in answer.choices)
    return [c.message.content for c in answer.choices if c.finish_reason == "stop"]


class Heard(logging.Handler):
    """Keeps the records it is handed."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture(autouse=True)
def quiet_server():
    """The server logs no warning or error while a test runs (a refusal is an answer, not a fault): heard
    on the root logger and on uvicorn's, which does not propagate."""
    heard, loggers = Heard(), [logging.getLogger(), logging.getLogger("uvicorn")]
    for logger in loggers:
        logger.addHandler(heard)
    yield
    for logger in loggers:
        logger.removeHandler(heard)
    assert not heard.records, [f"{r.name}: {r.getMessage()}" for r in heard.records]


def test_json_object_choices_that_stop_are_json_objects(live):
    # seed 0 at temperature 0.8: the random model closes its objects (a few bytes each) well within the limit
    answer = ask(live, "Give JSON.", temperature=0.8, seed=0, n=3, max_tokens=MAX_TOKENS,
                 response_format={"type": "json_object"})
    contents = stopped(answer)
    assert len(answer.choices) == 3 and contents
    assert all(isinstance(json.loads(c), dict) for c in contents), contents


def test_strict_json_schema_samples_validate(live):
    answer = ask(live, temperature=0.8, seed=1, n=4, max_tokens=MAX_TOKENS, response_format=STRICT)
    contents = stopped(answer)
    assert len(answer.choices) == 4 and contents
    values = [json.loads(c) for c in contents]
    assert all(valid_verdict(v) for v in values), values


def test_free_text_is_unconstrained_by_default(live):
    """The checker is not vacuous: the same request without response_format is no verdict."""
    answer = ask(live, temperature=0.8, seed=1, n=4, max_tokens=40)
    for content in (c.message.content for c in answer.choices):
        try:
            value = json.loads(content)
        except ValueError:
            continue
        assert not valid_verdict(value), content


def test_constrained_and_free_requests_batched_together(live):
    alone = [ask(live, p, max_tokens=24).choices[0].message.content for p in FREE_PROMPTS]
    start = threading.Barrier(8)

    def free(prompt: str) -> str:
        start.wait(30)
        return ask(live, prompt, max_tokens=24).choices[0].message.content

    def constrained(seed: int):
        start.wait(30)
        return ask(live, temperature=0.8, seed=seed, max_tokens=MAX_TOKENS, response_format=STRICT)

    with ThreadPoolExecutor(8) as pool:
        frees = [pool.submit(free, p) for p in FREE_PROMPTS]
        constrained_answers = [pool.submit(constrained, seed) for seed in range(4)]
        batched = [f.result(60) for f in frees]
        contents = [c for f in constrained_answers for c in stopped(f.result(60))]
    assert batched == alone  # greedy: a grammar beside them changes nothing of theirs
    assert contents and all(valid_verdict(json.loads(c)) for c in contents), contents


def test_streamed_json_schema_answer_validates(live):
    chunks = [c for c in ask(live, temperature=0.8, seed=2, max_tokens=MAX_TOKENS, response_format=STRICT,
                             stream=True) if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert valid_verdict(json.loads(text)), text


@pytest.mark.parametrize(("response_format", "param", "named"), [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strnig"}}},
     "response_format.json_schema.schema", "strnig"),
    ({"type": "json_schema", "json_schema": {"schema": SCHEMA}}, "response_format.json_schema.name", "name"),
    ({"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": True}}},
     "response_format.json_schema.schema", "additionalProperties"),
    ({"type": "json_object", "x": 1}, "response_format.x", "x"),
])
def test_unusable_formats_are_refused_naming_the_part(live, response_format, param, named):
    with pytest.raises(openai.BadRequestError) as refused:
        ask(live, max_tokens=4, response_format=response_format)
    assert refused.value.status_code == 400
    assert refused.value.param == param
    assert named in refused.value.message


def langchain_model(live, seed: int):
    return ChatOpenAI(base_url=live.url + "/v1", api_key="x", model=live.model, temperature=0.7,
                       max_tokens=MAX_TOKENS, max_retries=0, seed=seed)


def test_langchain_json_schema_output(live):
    value = langchain_model(live, seed=0).with_structured_output(SCHEMA, method="json_schema").invoke(
        "Give a verdict.")
    assert valid_verdict(value), value
    verdict = langchain_model(live, seed=0).with_structured_output(Verdict, method="json_schema").invoke(
        "Give a verdict.")
    assert isinstance(verdict, Verdict) and verdict.color in COLORS


def test_langchain_json_mode_output(live):
    # Any JSON object: the random model's keys are long random strings, and some seeds run past 200
    # tokens (LangChain's LengthFinishReasonError); seed 1 closes its object, the others are spares.
    for seed in (1, 2, 3):
        try:
            value = langchain_model(live, seed).with_structured_output(method="json_mode").invoke(
                "Answer in JSON.")
        except openai.LengthFinishReasonError:
            continue
        assert isinstance(value, dict), value
        return
    pytest.fail("no seed's JSON object finished within max_tokens")
