"""`kvlayout serve` with `[engine] speculate = "ngram"`: what the openai client gets is what it gets with
speculation off (greedy, and sampled with a seed), and /stats and /metrics count the drafts.

The model is the tiny preset nudged to repeat itself (tests/engines/test_speculation.py's Repeating),
so drafts are found; the server's own Pacing (timed) decides which to verify.
"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from tests.engines.test_speculation import Repeating
from tests.server.conftest import serving
from tests.server.test_monitor import settled

PROMPT = "Copy after me: one two three one two three one two three"


def answers(live) -> list[str]:
    client = live.client()
    greedy = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0)
    sampled = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=20, temperature=0.8, seed=7, n=2
    )
    return [greedy.choices[0].text, *(c.message.content for c in sampled.choices)]


def test_a_speculating_server_answers_as_one_that_does_not_and_counts_its_drafts(tiny_loaded):
    model = Repeating(tiny_loaded[0], tiny_loaded[1].vocab_size)
    with serving(tiny_loaded, model=model) as live:
        want = answers(live)
    with serving(tiny_loaded, {"engine": {"speculate": "ngram"}}, model=model) as live:
        got = answers(live)
        s = settled(live)
        conn = live.connection()
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    assert got == want
    assert 0 < s["accepted_tokens"] <= s["drafted_tokens"]
    samples = {x.name: x.value for f in text_string_to_metric_families(text) for x in f.samples}
    assert samples["kvlayout_drafted_tokens_total"] == s["drafted_tokens"]
    assert samples["kvlayout_accepted_tokens_total"] == s["accepted_tokens"]
