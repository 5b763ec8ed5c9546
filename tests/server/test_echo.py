"""The legacy completion's `echo` through the official `openai` client: the prompt written before the
answer and, with `logprobs`, the prompt's own logprobs (what lm-evaluation-harness's loglikelihood sends:
`max_tokens` 0 or 1, `logprobs` 1, `echo` true, temperature 0), whole and streamed, from the prefix cache
or not, from text or token ids; and the refusals of an echo that is not a bool and of max_tokens 0 alone.

The server runs the random Llama checkpoint mlx-lm writes (tests/server/test_logprobs.py: float32, byte
vocabulary, ASCII-scaled head). The oracle is mlx-lm's own model on the same directory, one cache-free
forward over the prompt and the generated ids, its log-softmax taken in float64 on the host: each echoed
prompt token i > 0 must carry row i-1's logprob and its top alternatives; the first none (no row predicts it).
The generated part is checked against the same request without echo (its logprobs are test_logprobs.py's).
"""

from __future__ import annotations

import numpy as np
import openai
import pytest

from tests.server.test_logprobs import PROMPT, PROMPT_IDS, TOLERANCE, byte_id, llama_fixtures, mlx_lm_logprobs, top_ids

STEPS = 3
TOP = 2


checkpoint, oracle, live = llama_fixtures("echo")


def complete(live, **kw):
    return live.client().completions.create(model=live.model, temperature=0, **kw)


def token_text(t: int) -> str:
    """A byte id's legacy token text: the character of an ASCII byte, `bytes:\\xNN` for any other."""
    return chr(t) if t < 128 else f"bytes:\\x{t:02x}"


def oracle_rows(model, ids: list[int]) -> np.ndarray:
    """`[len(ids) - 1, V]`: row j is mlx-lm's log-softmax predicting ids[j + 1] (one cache-free forward)."""
    return mlx_lm_logprobs(model, ids[:1], ids[1:])


def check_prompt_part(lp, model, prompt_ids: list[int]) -> None:
    """The first len(prompt_ids) entries of a legacy logprobs object are the prompt's, scored by mlx-lm."""
    n = len(prompt_ids)
    assert [byte_id(t) for t in lp.tokens[:n]] == prompt_ids
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    rows = oracle_rows(model, prompt_ids)
    want = [rows[i - 1, prompt_ids[i]] for i in range(1, n)]
    assert lp.token_logprobs[1:n] == pytest.approx(want, **TOLERANCE)
    for i in range(1, n):
        row = rows[i - 1]
        expected = {token_text(t): row[t] for t in top_ids(row, TOP)}
        assert lp.top_logprobs[i] == pytest.approx(expected, **TOLERANCE), f"prompt position {i}"


def check_offsets(lp) -> None:
    """text_offset starts at 0 and grows by each token's length (ASCII: one character a token)."""
    assert lp.text_offset[0] == 0
    assert lp.text_offset == [len("".join(lp.tokens[:k])) for k in range(len(lp.tokens))]
    assert all(b > a for a, b in zip(lp.text_offset, lp.text_offset[1:]))


def test_echo_with_logprobs_scores_the_prompt_as_mlx_lm_does(live, oracle):
    plain = complete(live, prompt=PROMPT, max_tokens=STEPS, logprobs=TOP).choices[0]
    choice = complete(live, prompt=PROMPT, max_tokens=STEPS, logprobs=TOP, echo=True).choices[0]
    lp, n = choice.logprobs, len(PROMPT_IDS)
    assert choice.text == PROMPT + plain.text and len(plain.text) == STEPS
    assert len(lp.tokens) == n + STEPS
    check_prompt_part(lp, oracle, PROMPT_IDS)
    # The generated part: the same tokens and logprobs as without echo.
    assert lp.tokens[n:] == plain.logprobs.tokens
    assert lp.token_logprobs[n:] == pytest.approx(plain.logprobs.token_logprobs, **TOLERANCE)
    for got, want in zip(lp.top_logprobs[n:], plain.logprobs.top_logprobs):
        assert got == pytest.approx(want, **TOLERANCE)
    # ... which are mlx-lm's too, over prompt + generated in one forward.
    ids = PROMPT_IDS + [byte_id(t) for t in plain.logprobs.tokens]
    rows = oracle_rows(oracle, ids)
    assert lp.token_logprobs[n:] == pytest.approx([rows[j - 1, ids[j]] for j in range(n, len(ids))], **TOLERANCE)
    assert "".join(lp.tokens) == choice.text
    check_offsets(lp)


def test_max_tokens_zero_with_echo_answers_only_the_prompt(live, oracle):
    answer = complete(live, prompt=PROMPT, max_tokens=0, logprobs=1, echo=True)
    choice = answer.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"  # as OpenAI's: no token was asked for
    assert [byte_id(t) for t in choice.logprobs.tokens] == PROMPT_IDS
    assert answer.usage.completion_tokens == 0 and answer.usage.prompt_tokens == len(PROMPT_IDS)
    rows = oracle_rows(oracle, PROMPT_IDS)
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(
        [rows[i - 1, PROMPT_IDS[i]] for i in range(1, len(PROMPT_IDS))], **TOLERANCE)
    check_offsets(choice.logprobs)


def test_echo_without_logprobs_is_the_prompt_then_the_answer(live):
    plain = complete(live, prompt=PROMPT, max_tokens=STEPS).choices[0]
    echoed = complete(live, prompt=PROMPT, max_tokens=STEPS, echo=True).choices[0]
    assert echoed.text == PROMPT + plain.text and plain.text
    assert echoed.logprobs is None


def test_streamed_echo_joins_to_the_whole_answer(live):
    whole = complete(live, prompt=PROMPT, max_tokens=STEPS, logprobs=TOP, echo=True).choices[0]
    chunks = [c.choices[0] for c in complete(live, prompt=PROMPT, max_tokens=STEPS, logprobs=TOP, echo=True,
                                             stream=True) if c.choices]
    parts = [c.logprobs for c in chunks if c.logprobs is not None]
    assert "".join(c.text for c in chunks) == whole.text
    assert chunks[0].text.startswith(PROMPT)  # the prompt comes first, in the first chunk
    assert [t for p in parts for t in p.tokens] == whole.logprobs.tokens
    assert [o for p in parts for o in p.text_offset] == whole.logprobs.text_offset
    streamed = [v for p in parts for v in p.token_logprobs]
    assert streamed[0] is None and whole.logprobs.token_logprobs[0] is None
    assert streamed[1:] == pytest.approx(whole.logprobs.token_logprobs[1:], **TOLERANCE)
    tops = [d for p in parts for d in p.top_logprobs]
    assert tops[0] is None
    for got, want in zip(tops[1:], whole.logprobs.top_logprobs[1:], strict=True):
        assert got == pytest.approx(want, **TOLERANCE)


def test_a_cached_prompt_is_still_scored_whole(live, oracle):
    prompt = "The cache keeps this prefix: " + "abcdefgh" * 8  # several cache blocks, its own to this test
    ids = list(prompt.encode())
    first = complete(live, prompt=prompt, max_tokens=1, logprobs=1, echo=True).choices[0].logprobs
    complete(live, prompt=prompt, max_tokens=1)
    again = complete(live, prompt=prompt, max_tokens=1)
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # the prefix is served from the cache
    second = complete(live, prompt=prompt, max_tokens=1, logprobs=1, echo=True).choices[0].logprobs
    assert second.tokens == first.tokens and len(second.tokens) == len(ids) + 1
    assert second.token_logprobs[0] is None
    assert second.token_logprobs[1:] == pytest.approx(first.token_logprobs[1:], **TOLERANCE)
    rows = oracle_rows(oracle, ids)
    assert second.token_logprobs[1:len(ids)] == pytest.approx([rows[i - 1, ids[i]] for i in range(1, len(ids))],
                                                               **TOLERANCE)


def test_a_prompt_of_token_ids_echoes_its_text(live):
    by_text = complete(live, prompt=PROMPT, max_tokens=STEPS, logprobs=1, echo=True).choices[0]
    by_ids = complete(live, prompt=PROMPT_IDS, max_tokens=STEPS, logprobs=1, echo=True).choices[0]
    assert by_ids.text == by_text.text and by_ids.text.startswith(PROMPT)
    assert by_ids.logprobs.tokens == by_text.logprobs.tokens
    assert by_ids.logprobs.token_logprobs[1:] == pytest.approx(by_text.logprobs.token_logprobs[1:], **TOLERANCE)


@pytest.mark.parametrize(("fields", "param"), [
    ({"echo": "yes", "max_tokens": 2}, "echo"),
    ({"echo": 1, "max_tokens": 2}, "echo"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"echo": False, "max_tokens": 0}, "max_tokens"),
])
def test_refusals_name_the_field(live, fields, param):
    with pytest.raises(openai.BadRequestError) as refused:
        live.client().completions.create(model=live.model, prompt=PROMPT, **fields)
    assert refused.value.status_code == 400
    assert refused.value.param == param
    assert param in refused.value.message
