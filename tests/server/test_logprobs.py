"""Logprobs through the official `openai` client: chat's `choices[].logprobs.content[]` (whole and
streamed), the legacy completion's `tokens` / `token_logprobs` / `top_logprobs` / `text_offset`,
sampled choices, and the refusals of values out of OpenAI's bounds.

The server runs a random Llama checkpoint written by mlx-lm itself (float32, byte vocabulary: id b < 256
is the byte b). The oracle is mlx-lm's own model on the same directory, run cache-free over the prompt
and the generated ids, its log-softmax taken in float64 on the host: what every reported logprob, every
top alternative (most likely first) and every greedy token must be.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx_lm.utils as mlx_lm_utils  # the independent oracle; a test extra, never skipped
import numpy as np
import openai
import pytest

from kvlayout.models.loading import load_model
from kvlayout.models.presets import preset_config
from tests.models.families import Checkpoint, write_checkpoint
from tests.server.conftest import serving

PROMPT = "Q: what is a KV cache?\nA:"
PROMPT_IDS = list(PROMPT.encode())  # the byte vocabulary: plain chat sends the one message's bytes
STEPS = 12
# float32 forwards (a batched, cached one against mlx-lm's cache-free one) on logits of about 10
TOLERANCE = {"rel": 1e-4, "abs": 1e-4}


def ascii_head(model: nn.Module) -> None:
    """Scale the output rows of ASCII ids by 8 and zero the rest: greedy text is ASCII (one character per
    token, so texts and token lists line up) and far from ties, and a sampled token is a byte but for
    odds near 1e-5 (the specials' rows give logit 0 against ASCII maxima near 10)."""
    w = model.lm_head.weight
    model.lm_head.weight = w * mx.where(mx.arange(w.shape[0]) < 128, 8.0, 0.0)[:, None]


def write_llama(out: Path) -> Path:
    """mlx-lm's random 2-layer Llama (the tiny preset's shapes, float32) as mlx-lm writes it."""
    config = {k: v for k, v in preset_config("tiny").items() if k != "torch_dtype"}
    return write_checkpoint(out, Checkpoint(config, tweak=ascii_head), seed=11)


def served(model_dir: Path) -> tuple:
    """What `serving` takes as the loaded model for `model_dir` (kvlayout's loader)."""
    model, args, tok = load_model(model_dir)
    return model, args, tok, str(model_dir)


def mlx_lm_logprobs(model: nn.Module, prompt: list[int], generated: list[int]) -> np.ndarray:
    """`[len(generated), V]` float64: mlx-lm's log-softmax for each generated position, one cache-free
    forward over the prompt and the generated ids but the last."""
    ids = prompt + generated[:-1]
    logits = np.array(model(mx.array(ids)[None])[0].astype(mx.float32), dtype=np.float64)[len(prompt) - 1:]
    peak = logits.max(axis=-1, keepdims=True)
    return logits - peak - np.log(np.exp(logits - peak).sum(axis=-1, keepdims=True))


def top_ids(row: np.ndarray, k: int) -> list[int]:
    """The k most likely ids of a log-softmax row, most likely first (the oracle's order)."""
    return [int(t) for t in np.argsort(-row, kind="stable")[:k]]


def byte_id(token: str) -> int:
    """The byte-vocabulary id of a legacy token's text: one character, or `bytes:\\xNN` for a lone byte."""
    if token.startswith("bytes:"):
        return int(token.removeprefix("bytes:\\x"), 16)
    raw = token.encode()
    assert len(raw) == 1, token
    return raw[0]


def llama_fixtures(name: str):
    """A module's fixtures over its own checkpoint: (checkpoint, oracle: mlx-lm's model on it, live: a
    server of it). Assigned to those names in a test module, pytest takes them as that module's."""

    @pytest.fixture(scope="module")
    def checkpoint(tmp_path_factory) -> Path:
        return write_llama(tmp_path_factory.mktemp(name) / "llama")

    @pytest.fixture(scope="module")
    def oracle(checkpoint) -> nn.Module:
        return mlx_lm_utils.load_model(checkpoint)[0]

    @pytest.fixture(scope="module")
    def live(checkpoint):
        with serving(served(checkpoint), {"model": {"path": str(checkpoint)}, "cache": {"capacity": 2048}}) as server:
            yield server

    return checkpoint, oracle, live


checkpoint, oracle, live = llama_fixtures("logprobs")


def chat(live, **kw):
    return live.client().chat.completions.create(model=live.model, messages=[{"role": "user", "content": PROMPT}],
                                                 max_tokens=STEPS, **kw)


def check_chat_entries(entries, want: np.ndarray, top: int) -> list[int]:
    """Each chat logprob entry against the oracle's row for its step (greedy); the ids, from their bytes."""
    ids = []
    for step, entry in enumerate(entries):
        row = want[step]
        assert len(entry.bytes) == 1  # one byte a token
        ids.append(entry.bytes[0])
        assert ids[-1] == top_ids(row, 1)[0], f"step {step}: not the greedy token"
        assert entry.token == chr(ids[-1])
        assert entry.logprob == pytest.approx(row[ids[-1]], **TOLERANCE)
        alternatives = [a.bytes[0] for a in entry.top_logprobs]
        assert alternatives == top_ids(row, top), f"step {step}"
        assert [a.token for a in entry.top_logprobs] == [chr(t) for t in alternatives]
        assert [a.logprob for a in entry.top_logprobs] == pytest.approx(row[alternatives].tolist(), **TOLERANCE)
    return ids


def test_chat_logprobs_and_top_logprobs_are_mlx_lms_log_softmax(live, oracle):
    answer = chat(live, logprobs=True, top_logprobs=3)
    choice = answer.choices[0]
    entries = choice.logprobs.content
    assert len(entries) == answer.usage.completion_tokens == STEPS
    ids = [e.bytes[0] for e in entries]
    ids = check_chat_entries(entries, mlx_lm_logprobs(oracle, PROMPT_IDS, ids), top=3)
    assert "".join(e.token for e in entries) == choice.message.content == bytes(ids).decode()
    assert len(set(ids)) > 1  # the steps' rows differ: an answer repeating one row would not pass


def test_streamed_chunks_carry_their_own_tokens_logprobs(live):
    whole = chat(live, logprobs=True, top_logprobs=3).choices[0].logprobs.content
    chunks = [c for c in chat(live, logprobs=True, top_logprobs=3, stream=True) if c.choices]
    streamed = []
    for c in chunks:
        delta, logprobs = c.choices[0].delta, c.choices[0].logprobs
        if logprobs is None:
            assert not delta.content  # the role's opening chunk, or the finish
            continue
        assert "".join(e.token for e in logprobs.content) == delta.content  # this chunk's tokens, no other's
        streamed += logprobs.content
    assert [(e.token, e.bytes) for e in streamed] == [(e.token, e.bytes) for e in whole]
    for got, want in zip(streamed, whole):  # the second request's prompt comes from the prefix cache
        assert got.logprob == pytest.approx(want.logprob, **TOLERANCE)
        assert [(a.token, a.bytes) for a in got.top_logprobs] == [(a.token, a.bytes) for a in want.top_logprobs]
        assert [a.logprob for a in got.top_logprobs] == pytest.approx([a.logprob for a in want.top_logprobs],
                                                                      **TOLERANCE)


def test_legacy_completion_logprobs_are_mlx_lms(live, oracle):
    answer = live.client().completions.create(model=live.model, prompt=PROMPT, max_tokens=STEPS, logprobs=2)
    choice = answer.choices[0]
    lp = choice.logprobs
    ids = [byte_id(t) for t in lp.tokens]
    want = mlx_lm_logprobs(oracle, PROMPT_IDS, ids)
    assert len(ids) == STEPS and "".join(lp.tokens) == choice.text
    assert ids == [top_ids(row, 1)[0] for row in want]  # greedy
    assert lp.token_logprobs == pytest.approx([want[k, t] for k, t in enumerate(ids)], **TOLERANCE)
    for step, alternatives in enumerate(lp.top_logprobs):
        expected = {chr(t): want[step, t] for t in top_ids(want[step], 2)}
        assert alternatives == pytest.approx(expected, **TOLERANCE)
    # Running character offsets into the generated text (vLLM's: the prompt is not echoed).
    assert lp.text_offset == [len("".join(lp.tokens[:k])) for k in range(len(ids))]
    parts = [c.choices[0].logprobs for c in live.client().completions.create(
        model=live.model, prompt=PROMPT, max_tokens=STEPS, logprobs=2, stream=True) if c.choices and c.choices[0].text]
    assert [t for p in parts for t in p.tokens] == lp.tokens
    assert [o for p in parts for o in p.text_offset] == lp.text_offset  # offsets run on across chunks


def test_without_logprobs_a_choice_has_none(live):
    assert chat(live).choices[0].logprobs is None
    assert live.client().completions.create(model=live.model, prompt=PROMPT, max_tokens=4).choices[0].logprobs is None
    assert all(c.choices[0].logprobs is None for c in chat(live, stream=True) if c.choices)


def test_sampled_choices_report_the_raw_logprobs_of_their_own_tokens(live, oracle):
    # temperature 0.8: the reported logprobs are the model's, before temperature (a scaled one would differ)
    answer = live.client().completions.create(model=live.model, prompt=PROMPT, max_tokens=STEPS, n=2,
                                              temperature=0.8, seed=7, logprobs=1)
    samples = [[byte_id(t) for t in c.logprobs.tokens] for c in sorted(answer.choices, key=lambda c: c.index)]
    assert samples[0] != samples[1]  # two draws, each checked on its own tokens
    for choice, ids in zip(sorted(answer.choices, key=lambda c: c.index), samples):
        assert len(ids) == STEPS
        want = mlx_lm_logprobs(oracle, PROMPT_IDS, ids)
        assert choice.logprobs.token_logprobs == pytest.approx([want[k, t] for k, t in enumerate(ids)], **TOLERANCE)
        assert [list(a) for a in choice.logprobs.top_logprobs] == [[chr(top_ids(row, 1)[0])] for row in want]


@pytest.mark.parametrize(("chat_request", "fields", "param"), [
    (True, {"top_logprobs": 2}, "top_logprobs"),
    (True, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (False, {"logprobs": 21}, "logprobs"),
    (True, {"logit_bias": {"258": 5}}, "logit_bias.258"),
    (False, {"logit_bias": {"65": 101}}, "logit_bias.65"),
    (True, {"presence_penalty": 3}, "presence_penalty"),
    (False, {"frequency_penalty": -2.5}, "frequency_penalty"),
])
def test_out_of_bounds_values_are_refused_naming_the_field(live, chat_request, fields, param):
    client = live.client()
    with pytest.raises(openai.BadRequestError) as refused:
        if chat_request:
            client.chat.completions.create(model=live.model, messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=2, **fields)
        else:
            client.completions.create(model=live.model, prompt="hi", max_tokens=2, **fields)
    assert refused.value.status_code == 400
    assert refused.value.param == param
    assert param.split(".")[0] in refused.value.message
