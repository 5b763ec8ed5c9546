"""`server.prefix_store` on the real SmolLM2-135M-Instruct: a prefix a stopped server stored, loaded by the next
one, gives the same greedy answer as prefilling every token (issue 30).

Three in-process servers (tests/server/conftest.py `serving`) share one model, loaded once, 4-bit as stored (the
test process preloads no fast BLAS, so the model is not dequantized: ~6 prompt tokens/s on two cores, hence
prompts of ~50 tokens and max_tokens 3): the first, with a store, answers a chat and stops (writing what it kept);
the second, on the same store, answers another question under the same system prompt, its system prompt loaded
from the store (cached_tokens > 0); the third, with no prefix cache at all, answers that question, every token
prefilled: the oracle. About 40 s here.

    pytest tests/server/test_prefix_store_smollm2.py
"""

from __future__ import annotations

import pytest

from kvlayout.models import smollm2
from kvlayout.runner.config import ModelSection
from kvlayout.runner.job import load_model_for
from kvlayout.server.config import ServeConfig
from tests.server.conftest import serving

SYSTEM = ("You are a patient geography teacher for a class of curious children. Answer every question about "
          "cities, rivers and mountains in one short, friendly sentence.")
FIRST_QUESTION = "Which river flows through Paris?"
SECOND_QUESTION = "Which river flows through London?"


@pytest.fixture(scope="module")
def smollm2_loaded():
    """(model directory, the loaded model): fetched and converted once, then cached; loaded once per module."""
    model_dir = smollm2.smollm2_dir(progress=lambda line: None)
    return model_dir, load_model_for(ServeConfig(model=ModelSection(path=str(model_dir))))


def config_for(model_dir, server: dict) -> dict:
    return {"model": {"path": str(model_dir)}, "cache": {"capacity": 1024}, "server": {"max_tokens": 3, **server}}


def answer(live, question: str) -> tuple[str, int]:
    """(text, cached prompt tokens) of one greedy chat answer under SYSTEM."""
    r = live.client().chat.completions.create(
        model=live.model, messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        max_tokens=3, temperature=0,
    )
    return r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens


def test_an_answer_from_a_stored_prefix_is_the_answer_without_it(smollm2_loaded, tmp_path):
    model_dir, loaded = smollm2_loaded
    stored = config_for(model_dir, {"prefix_store": str(tmp_path / "store")})
    with serving(loaded, stored) as live:
        first_text, first_cached = answer(live, FIRST_QUESTION)
    assert first_text and first_cached == 0  # cold: nothing in the cells, nothing stored yet
    assert any(p.suffix == ".json" for p in (tmp_path / "store").iterdir()), "the first server stored nothing"
    with serving(loaded, stored) as live:
        from_store, cached = answer(live, SECOND_QUESTION)
        store_health = live.health()["prefix_cache"]["store"]
    with serving(loaded, config_for(model_dir, {"prefix_cache": False})) as live:
        prefilled, uncached = answer(live, SECOND_QUESTION)
    assert cached >= 32 and uncached == 0  # the system prompt (~35 tokens, to within a block) came from the store
    assert store_health["hits"] == 1
    assert from_store == prefilled
