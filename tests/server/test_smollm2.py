"""The real SmolLM2-135M-Instruct behind the server: it answers a chat as a chat model should."""

from __future__ import annotations

from kvlayout.models import smollm2
from tests.server.conftest import serving


def test_smollm2_served_answers_the_capital_of_france_with_paris():
    model_dir = smollm2.smollm2_dir(progress=lambda line: None)  # fetched and converted once, then cached
    config = {"model": {"path": str(model_dir)}, "cache": {"capacity": 1024}, "server": {"max_tokens": 64}}
    with serving(None, config) as live:
        assert live.model == model_dir.name
        r = live.client().chat.completions.create(
            model=live.model, messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=12, temperature=0,
        )
    assert "Paris" in r.choices[0].message.content
    assert r.usage.prompt_tokens > 20  # the chat template's default system prompt came with it
