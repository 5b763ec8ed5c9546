"""The server's sampling defaults and the engine's logit shaping, through the official `openai` client.

A request naming no temperature samples at the config's [sampling] temperature, else the model
directory's generation_config.json's, else OpenAI's 1.0; a generation_config.json value out of range
stops the server at start, naming the file. The oracles: the same request with that temperature named
(same seed: the same draws), temperature 0 (greedy), and, for `logit_bias` and the penalties, mlx-lm's
own model on the checkpoint it wrote, its logits shaped by OpenAI's rule step by step in numpy
(logit[j] += bias[j] - frequency * count_j - presence * (count_j > 0)) and the argmax taken.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import mlx_lm.utils as mlx_lm_utils  # the independent oracle; a test extra, never skipped
import numpy as np
import pytest

from kvlayout.errors import ConfigError
from kvlayout.server.config import ServeConfig
from kvlayout.server.service import prepare_service
from tests.server.conftest import TINY, merged, serving
from tests.server.test_logprobs import PROMPT, PROMPT_IDS, served, write_llama

STEPS = 8
NO_SAMPLING = {"sampling": {"temperature": None}}  # as a config without [sampling] leaves it (TINY says 0)


def texts(live, n: int = 4, **kw) -> list[str]:
    """The n choices' texts of one completion of PROMPT, in choice order."""
    answer = live.client().completions.create(model=live.model, prompt=PROMPT, max_tokens=STEPS, n=n, **kw)
    return [c.text for c in sorted(answer.choices, key=lambda c: c.index)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_llama(tmp_path_factory.mktemp("defaults") / "llama")


@pytest.fixture(scope="module")
def greedy_live(checkpoint):
    with serving(served(checkpoint), model_config(checkpoint)) as live:  # greedy ([sampling] temperature 0)
        yield live


def with_generation_config(checkpoint: Path, out: Path, settings: dict) -> Path:
    """A copy of `checkpoint` whose generation_config.json holds `settings`."""
    shutil.copytree(checkpoint, out)
    (out / "generation_config.json").write_text(json.dumps(settings))
    return out


def model_config(model_dir: Path, extra: dict | None = None) -> dict:
    return {"model": {"path": str(model_dir)}, "cache": {"capacity": 2048}, **(extra or {})}


def test_without_sampling_config_or_generation_config_requests_sample_at_1(tiny_loaded):
    with serving(tiny_loaded, NO_SAMPLING) as live:
        default = texts(live, seed=3)
        assert len(set(default)) >= 2  # sampled, not greedy
        assert default == texts(live, seed=3, temperature=1.0)  # OpenAI's 1.0: the same draws
        assert len(set(texts(live, temperature=0))) == 1


def test_a_generation_config_temperature_of_0_makes_requests_greedy(checkpoint, tmp_path):
    model_dir = with_generation_config(checkpoint, tmp_path / "greedy", {"temperature": 0.0})
    with serving(served(model_dir), model_config(model_dir, NO_SAMPLING)) as live:
        greedy = texts(live, n=1, temperature=0)
        assert texts(live, seed=5) == greedy * 4
        assert texts(live, seed=5, temperature=1.0) != greedy * 4  # the check above could fail


def test_the_configs_sampling_wins_over_the_generation_configs(checkpoint, tmp_path):
    model_dir = with_generation_config(checkpoint, tmp_path / "warm", {"temperature": 0.7})
    loaded = served(model_dir)
    with serving(loaded, model_config(model_dir, NO_SAMPLING)) as live:  # the file's 0.7 is read
        warm = texts(live, seed=9)
        assert warm == texts(live, seed=9, temperature=0.7) and len(set(warm)) >= 2
    with serving(loaded, model_config(model_dir, {"sampling": {"temperature": 0}})) as live:
        assert texts(live, seed=9) == texts(live, n=1, temperature=0) * 4


@pytest.mark.parametrize("temperature", ["hot", 5, -0.5, True])
def test_a_generation_config_temperature_out_of_range_stops_the_server(checkpoint, tmp_path, temperature):
    model_dir = with_generation_config(checkpoint, tmp_path / "bad", {"temperature": temperature})
    cfg = ServeConfig.from_mapping(merged(TINY, model_config(model_dir, NO_SAMPLING)), source="test")
    with pytest.raises(ConfigError) as refused:
        prepare_service(cfg, served(model_dir))
    assert str(model_dir / "generation_config.json") in str(refused.value)
    assert "temperature" in str(refused.value)


def shaped_greedy(model, prompt: list[int], steps: int, bias: dict[int, float], frequency: float,
                  presence: float) -> list[int]:
    """The oracle: greedy ids from mlx-lm's logits (float64 on the host) shaped by OpenAI's rule, each step's
    counts over the tokens generated so far."""
    ids: list[int] = []
    for _ in range(steps):
        logits = np.array(model(mx.array(prompt + ids)[None])[0, -1].astype(mx.float32), dtype=np.float64)
        for token, amount in bias.items():
            logits[token] += amount
        counts = np.bincount(np.asarray(ids, dtype=np.int64), minlength=logits.size)
        logits -= frequency * counts + presence * (counts > 0)
        ids.append(int(np.argmax(logits)))
    return ids


@pytest.mark.parametrize(("bias", "frequency", "presence"), [
    ({65: 100.0}, 0.0, 0.0),
    ({}, 1.5, 0.0),
    ({}, 0.0, 1.0),
    ({101: -100.0}, 0.5, 0.5),
])
def test_logit_bias_and_penalties_shape_greedy_as_mlx_lm_logits_do(checkpoint, greedy_live, bias, frequency,
                                                                    presence):
    oracle = mlx_lm_utils.load_model(checkpoint)[0]
    steps = 16
    want = shaped_greedy(oracle, PROMPT_IDS, steps, bias, frequency, presence)
    assert want != shaped_greedy(oracle, PROMPT_IDS, steps, {}, 0.0, 0.0)  # the shaping changes the answer
    if bias.get(65) == 100.0:
        assert want == [65] * steps
    answer = greedy_live.client().chat.completions.create(
        model=greedy_live.model, messages=[{"role": "user", "content": PROMPT}], max_tokens=steps,
        logit_bias={str(t): a for t, a in bias.items()}, frequency_penalty=frequency, presence_penalty=presence)
    assert answer.choices[0].message.content == bytes(want).decode()
