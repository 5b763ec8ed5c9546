"""Every architecture beyond Llama against mlx-lm on checkpoints mlx-lm wrote (tests/models/families.py).

For each row: logits of a cache-free forward equal mlx-lm's forward within 1e-4 (float32); greedy
ids through `kvlayout run`'s engine equal mlx-lm's `generate_step` on both layouts, on a prompt
longer than the smallest sliding window; and on mlx:cell a ragged batch of 4 sharing a prefix
(prefill chunks beside decodes on one step, the prefix reused) gives each sample what mlx-lm gives
it alone.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx_lm.utils as mlx_lm_utils  # the independent oracle; a test extra, never skipped
import numpy as np
import pytest

import kvlayout
from kvlayout.models.loading import load_model
from kvlayout.runner import job
from tests.models.families import CHECKPOINTS, write_checkpoint
from tests.models.quantized import mlx_lm_greedy
from tests.runner.conftest import NoCache, make_config

RNG = np.random.default_rng(5)
PROMPT = [int(t) for t in RNG.integers(0, 256, 21)]  # longer than every row's window
PREFIX = [int(t) for t in RNG.integers(0, 256, 13)]
SUFFIXES = [[int(t) for t in RNG.integers(0, 256, n)] for n in (1, 3, 6, 9)]  # ragged


@pytest.fixture(scope="module", autouse=True)
def _layouts_installed():
    for kind in ("seq", "cell"):
        kvlayout.resolve("mlx", kind)  # the real plugins, through the registry


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """checkpoint(name) -> the directory mlx-lm wrote for CHECKPOINTS[name] (once per module)."""
    root, made = tmp_path_factory.mktemp("families"), {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = write_checkpoint(root / name, CHECKPOINTS[name])
        return made[name]

    return get


def greedy(model_dir: Path, layout: str, prompts: list[list[int]], max_tokens: int, chunk: int = 64):
    cfg = make_config(model_dir, layout, requests=[{"prompt_ids": p, "max_tokens": max_tokens} for p in prompts],
                      model={"dequantize": False}, engine={"prefill_chunk": chunk})
    result = job.run(cfg)
    return [out[0].token_ids for out in result.outputs], result


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_logits_equal_mlx_lm_on_the_checkpoint_it_wrote(checkpoint, name):
    ours, args, _ = load_model(checkpoint(name))
    theirs, _ = mlx_lm_utils.load_model(checkpoint(name))
    ids = PROMPT + PREFIX
    got = ours(ids, range(len(ids)), NoCache(args.windows))  # [T, V]
    want = theirs(mx.array(ids)[None])[0]  # [T, V]
    assert got.shape == want.shape
    assert mx.abs(got - want).max().item() < 1e-4


@pytest.mark.parametrize("layout", ["mlx:seq", "mlx:cell"])
@pytest.mark.parametrize("name", CHECKPOINTS)
def test_greedy_ids_equal_mlx_lm_generate_step(checkpoint, name, layout):
    model_dir = checkpoint(name)
    assert len(PROMPT) > CHECKPOINTS[name].window
    got, _ = greedy(model_dir, layout, [PROMPT], 6)
    assert got[0] == mlx_lm_greedy(model_dir, PROMPT, 6, eos=[])
    assert len(got[0]) == 6


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_a_ragged_batch_sharing_a_prefix_equals_each_alone(checkpoint, name):
    model_dir = checkpoint(name)
    prompts = [PREFIX + s for s in SUFFIXES]
    got, result = greedy(model_dir, "mlx:cell", prompts, 5, chunk=8)  # chunks of 8: prefills beside decodes
    for prompt, ids in zip(prompts, got):
        assert ids == mlx_lm_greedy(model_dir, prompt, 5, eos=[])
