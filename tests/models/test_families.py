"""Every architecture beyond Llama against mlx-lm on checkpoints mlx-lm wrote (tests/models/families.py).

For each row: logits of a cache-free forward equal mlx-lm's forward within 1e-4 (float32); greedy
ids through `kvlayout run`'s engine equal mlx-lm's `generate_step` on both layouts, on a prompt
longer than the smallest sliding window; and on mlx:cell a ragged batch of 4 sharing a prefix
(prefill chunks beside decodes on one step, the prefix reused) gives each sample what mlx-lm gives
it alone.
"""

from __future__ import annotations

import re
from pathlib import Path

import mlx.core as mx
import mlx_lm.utils as mlx_lm_utils  # the independent oracle; a test extra, never skipped
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import QuantizedKVCache

import kvlayout
from kvlayout.models.loading import load_model
from kvlayout.runner import job
from tests.models.families import ALL as CHECKPOINTS
from tests.models.families import write_checkpoint
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


def quantized_kv_greedy(model, args, layout: str, prompt: list[int], steps: int = 6, chunk: int = 4) -> list[int]:
    """Greedy tokens through a q8 (groups of 32) cache of `layout` with the model's own layers (windows
    included): the prompt in steps of `chunk` tokens (a ring layer takes at most its window a step),
    then one token a step."""
    config = kvlayout.CacheConfig(capacity=128, n_layers=args.num_hidden_layers, layers=args.layer_configs(),
                                  kv_dtype="q8", kv_group_size=32)
    cache = kvlayout.build(*layout.split(":"), config)
    seq = cache.as_batch_control().seq_new() if layout == "mlx:cell" else None
    tokens, start, out = list(prompt), 0, []
    while len(out) < steps:
        new = tokens[start : start + chunk]
        if seq is not None:
            assert cache.as_batch_control().declare_step([seq] * len(new))
        logits = model(new, range(start, start + len(new)), cache, rows=[len(new) - 1])  # [1, V]
        start += len(new)
        if start == len(tokens):  # the last of the tokens so far: its logits give the next one
            out.append(int(mx.argmax(logits[0]).item()))
            tokens.append(out[-1])
    return out


def mlx_lm_quantized_kv_greedy(model_dir: Path, prompt: list[int], steps: int = 6) -> list[int]:
    """mlx-lm's generate_step in float16 over a QuantizedKVCache (8 bits, groups of 32) from the prefill on."""
    theirs, _ = mlx_lm_utils.load_model(model_dir)
    theirs.set_dtype(mx.float16)
    cache = [QuantizedKVCache(group_size=32, bits=8) for _ in theirs.layers]
    out = generate_step(mx.array(prompt), theirs, max_tokens=steps, prompt_cache=cache,
                        sampler=lambda x: mx.argmax(x, -1))
    return [int(t) for t, _ in out]


def float_experts(c) -> bool:
    """Float MoE experts: MLX's gather_mm multiplies them in float32 only on the CPU, so not in float16."""
    return c.bits is None and c.config["model_type"] in ("qwen3_moe", "gpt_oss")


# mlx-lm's quantized cache has neither a window (RotatingKVCache does not quantize) nor sinks (its
# quantized SDPA refuses them), and its float16 model cannot run float experts here: rows with any of
# these are checked layout against layout below.
PLAIN = [n for n, c in CHECKPOINTS.items() if not c.window and "sliding_window" not in c.config
         and c.config["model_type"] != "gpt_oss" and not float_experts(c)]


@pytest.mark.parametrize("name", PLAIN)
def test_quantized_kv_equals_mlx_lm_quantized_kv_cache(checkpoint, name):
    """kvlayout quantizes K/V from float16 (its scales are float16); so does mlx-lm on a float16 model."""
    model, args, _ = load_model(checkpoint(name), "float16")
    want = mlx_lm_quantized_kv_greedy(checkpoint(name), PROMPT)
    for layout in ("mlx:seq", "mlx:cell"):
        assert quantized_kv_greedy(model, args, layout, PROMPT) == want, layout


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_quantized_kv_gives_each_layout_the_same_tokens(checkpoint, name):
    """Windows and sinks over quantized K/V: the cell layout's grouped/masked paths against the seq
    layout's own ring and dense ones, past the window."""
    model, args, _ = load_model(checkpoint(name), "float32" if float_experts(CHECKPOINTS[name]) else "float16")
    seq = quantized_kv_greedy(model, args, "mlx:seq", PROMPT + PREFIX, steps=8)
    assert quantized_kv_greedy(model, args, "mlx:cell", PROMPT + PREFIX, steps=8) == seq


def test_half_precision_float_experts_on_the_cpu_are_refused_in_one_line(checkpoint, capsys, tmp_path):
    """MLX's gather_mm multiplies float experts in float32 only on the CPU: a float16 run would fail at
    its first step with MLX's own error; it is refused at load naming the layer and the setting."""
    from tests.helpers import refused_in_one_line

    assert mx.default_device() == mx.cpu
    model_dir = checkpoint("qwen3_moe")
    config = tmp_path / "run.toml"
    config.write_text(f'[model]\npath = "{model_dir}"\ndtype = "float16"\n[[requests]]\nprompt = "hi"\n')
    line = refused_in_one_line(capsys, "run", str(config))
    layer = r"model\.layers\.\d\.mlp\.switch_mlp\.\w+_proj"
    assert re.search(rf"{re.escape(str(model_dir))}: {layer} holds float experts in float16", line), line
    assert 'set [model] dtype = "float32"' in line
    load_model(checkpoint("qwen3_moe_q4_mixed"), "float16")  # packed experts run in any dtype
