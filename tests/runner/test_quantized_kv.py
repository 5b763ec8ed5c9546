"""Quantized K/V through the model: mlx-lm's QuantizedKVCache is the oracle for one sequence, and
a batched mlx:cell run gives every sequence what mlx:seq gives it alone at the same bits.

The model runs in float16 against mlx-lm: kvlayout quantizes K/V from float16 whatever the
model's dtype (its scales are float16), mlx-lm from the model's dtype, so on a float16 model
both store the same triples and the greedy tokens must agree exactly.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx_lm.utils as mlx_lm_utils  # the independent oracle; a test extra, never skipped
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import QuantizedKVCache

import kvlayout
from kvlayout.errors import ConfigError
from kvlayout.models.loading import load_model
from kvlayout.models.presets import write_preset
from kvlayout.runner import job
from kvlayout.runner.report import print_report
from tests.runner.conftest import QUESTIONS, SYSTEM, make_config, token_ids

STEPS = 10


@pytest.fixture(scope="module")
def d64_dir(tmp_path_factory) -> Path:
    """The tiny preset with head_dim 64, which every group size divides (the preset's 16 none)."""
    return write_preset(tmp_path_factory.mktemp("tiny_d64"), "tiny", seed=3, head_dim=64)


@pytest.fixture(scope="module")
def d64_loaded(d64_dir):
    model, args, tok = load_model(d64_dir)
    return model, args, tok, str(d64_dir)


def mlx_lm_greedy(model_dir: Path, prompt: list[int], bits: int, group: int) -> list[int]:
    theirs, _ = mlx_lm_utils.load_model(model_dir)
    theirs.set_dtype(mx.float16)
    cache = [QuantizedKVCache(group_size=group, bits=bits) for _ in theirs.layers]  # quantized from the prefill on
    steps = generate_step(
        mx.array(prompt), theirs, max_tokens=STEPS, prompt_cache=cache, sampler=lambda x: mx.argmax(x, -1)
    )
    return [int(t) for t, _ in steps]


def our_greedy(model, args, layout: str, prompt: list[int], kv_dtype: str, group: int) -> list[int]:
    """Greedy tokens through a cache of `layout`, the whole prompt as one step, then one token a step."""
    layers = args.layer_configs()
    config = kvlayout.CacheConfig(
        capacity=128, n_layers=args.num_hidden_layers, layers=layers[:1], kv_dtype=kv_dtype, kv_group_size=group
    )
    cache = kvlayout.build(*layout.split(":"), config)
    seq = cache.as_batch_control().seq_new() if layout == "mlx:cell" else None
    tokens, start, out = list(prompt), 0, []
    for _ in range(STEPS):
        new = tokens[start:]
        if seq is not None:
            assert cache.as_batch_control().declare_step([seq] * len(new))
        logits = model(new, range(start, start + len(new)), cache, rows=[len(new) - 1])  # [1, V]
        out.append(int(mx.argmax(logits[0]).item()))
        start = len(tokens)
        tokens.append(out[-1])
    return out


@pytest.mark.parametrize("kv_dtype,bits,group", [("q8", 8, 64), ("q4", 4, 64), ("q4", 4, 32), ("q8", 8, 32)])
def test_one_sequence_equals_mlx_lm_quantized_kv_cache(d64_dir, kv_dtype, bits, group):
    model, args, _ = load_model(d64_dir, "float16")
    prompt = [int(t) for t in np.random.default_rng(1).integers(0, 256, 30)]
    want = mlx_lm_greedy(Path(d64_dir), prompt, bits, group)
    assert len(want) == STEPS
    for layout in ("mlx:seq", "mlx:cell"):
        assert our_greedy(model, args, layout, prompt, kv_dtype, group) == want, layout


def test_mlx_lm_oracle_tells_bits_apart(d64_dir):
    """The oracle can fail: 4 and 8 bits give other tokens on this model (so agreement above means something)."""
    prompt = [int(t) for t in np.random.default_rng(1).integers(0, 256, 30)]
    assert mlx_lm_greedy(Path(d64_dir), prompt, 4, 64) != mlx_lm_greedy(Path(d64_dir), prompt, 8, 64)


@pytest.mark.parametrize("kv_dtype", ["q8", "q4"])
def test_a_batched_cell_run_gives_each_sequence_what_seq_gives_it_alone(d64_loaded, d64_dir, kv_dtype):
    requests = [{"prompt": SYSTEM + q, "max_tokens": 8, "n": 2} for q in QUESTIONS]
    runs = {
        layout: job.run(
            make_config(d64_dir, layout, requests=requests, cache={"kv_dtype": kv_dtype}, engine={"prefill_chunk": 16}),
            loaded=d64_loaded,
        )
        for layout in ("mlx:seq", "mlx:cell")
    }
    seq, cell = runs["mlx:seq"], runs["mlx:cell"]
    assert cell.stats.max_batch > 1 and seq.stats.max_batch == 1
    assert cell.stats.peak_cells < cell.stats.peak_tokens  # the forks shared their prompt's quantized cells
    assert token_ids(cell) == token_ids(seq)
    # And the bits matter: float32 K/V gives other tokens somewhere on this random model.
    floats = job.run(
        make_config(d64_dir, "mlx:cell", requests=requests, engine={"prefill_chunk": 16}), loaded=d64_loaded
    )
    assert token_ids(floats) != token_ids(cell) or kv_dtype == "q8"


def test_the_run_reports_kv_bytes_beside_float16(d64_loaded, d64_dir, capsys):
    cfg = make_config(d64_dir, "mlx:cell", requests=[{"prompt": SYSTEM, "max_tokens": 3}], cache={"kv_dtype": "q4"})
    result = job.run(cfg, loaded=d64_loaded)
    sizes = result.kv_bytes
    # 2 layers x K and V x 2 heads x (64 elements at 4 bits = 32 B, + one float16 scale and bias = 4 B).
    assert sizes.per_cell == 2 * 2 * 2 * 36
    assert sizes.float16_per_cell == 2 * 2 * 2 * 128
    assert sizes.cells == result.stats.peak_cells > 0
    assert result.to_json()["kv_bytes"]["held"] == sizes.per_cell * result.stats.peak_cells
    assert result.to_json()["kv_bytes"]["float16_held"] == sizes.float16_per_cell * result.stats.peak_cells
    print_report(result)
    assert "as float16" in capsys.readouterr().out


def test_a_head_dim_no_group_divides_is_refused_before_a_cache_is_built(tiny_loaded, tiny_dir, monkeypatch):
    class NoBuild:
        key = "mlx:cell"

        def build(self, config):
            pytest.fail(f"built a cache for {config}")

    monkeypatch.setattr(job.registry, "resolve", lambda *a, **k: NoBuild())
    cfg = make_config(tiny_dir, "mlx:cell", cache={"kv_dtype": "q4"})  # the tiny preset's head_dim is 16
    with pytest.raises(ConfigError, match="head_dim=16 does not divide into groups of 64"):
        job.prepare(cfg, loaded=tiny_loaded)
