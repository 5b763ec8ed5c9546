"""Random checkpoints written by mlx-lm itself, for the architectures beyond Llama (the oracle's own files).

Vocabularies are the byte vocabulary (258 ids), so kvlayout reads the directories without a tokenizer.json.

Each row of `CHECKPOINTS` is an mlx-lm config dict (small shapes, a sliding window shorter than the
test prompts where the family has one) and how to write it: mlx-lm's `Model` class for the
model_type with its random initial weights, optionally packed by `mlx_lm.utils.quantize_model`
(mixed bits through a predicate, as mlx-community directories are), saved by mlx-lm's
`save_model` / `save_config`: the layout of an mlx-community directory. kvlayout then loads the
directory and mlx-lm's implementation on the same files is the oracle.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx
import mlx.nn as nn
import mlx_lm.utils as mlx_lm_utils  # the independent oracle; a test extra, never skipped
from mlx.utils import tree_flatten


@attrs.frozen
class Checkpoint:
    config: dict[str, Any]
    bits: int | None = None  # None: floats
    group_size: int = 32
    predicate: Callable[[str, nn.Module], bool | dict] | None = None  # quantize_model's quant_predicate
    drop: tuple[str, ...] = ()  # top-level modules removed before saving (a tied head: "lm_head")
    window: int = 0  # the smallest sliding window, 0 for none: the prompts are longer
    tweak: Callable[[nn.Module], None] | None = None  # changes mlx-lm's initial weights before saving


def mlx_lm_model(config: dict[str, Any], seed: int = 0) -> nn.Module:
    """mlx-lm's model for `config` with its own random initial weights (seeded)."""
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    return model


def write_checkpoint(out: Path, ckpt: Checkpoint, seed: int = 0) -> Path:
    """The directory mlx-lm writes for `ckpt`: config.json and model.safetensors."""
    config = dict(ckpt.config)
    model = mlx_lm_model(config, seed)
    if ckpt.tweak is not None:
        ckpt.tweak(model)
        mx.eval(model.parameters())
    for name in ckpt.drop:
        model.pop(name)
    if ckpt.bits is not None:
        model, config = mlx_lm_utils.quantize_model(
            model, config, ckpt.group_size, ckpt.bits, quant_predicate=ckpt.predicate
        )
    out.mkdir(parents=True, exist_ok=True)
    mlx_lm_utils.save_model(out, model)
    mlx_lm_utils.save_config(config, out / "config.json")
    return out


def float_tensors(model_dir: Path) -> dict[str, mx.array]:
    return dict(tree_flatten(mlx_lm_utils.load_model(Path(model_dir))[0].parameters()))


def mixed_bits(path: str, module: nn.Module) -> bool | dict:
    """Mixed per-module bits, as mlx-lm's recipes write them: attention's v/o projections and the
    down projections 8-bit, the rest the default."""
    if path.endswith(("v_proj", "o_proj", "down_proj")):
        return {"group_size": 32, "bits": 8}
    return True


QWEN3 = {
    "model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "rms_norm_eps": 1e-6,
    "vocab_size": 258, "max_position_embeddings": 2048, "rope_theta": 1000000.0, "tie_word_embeddings": False,
}

CHECKPOINTS: dict[str, Checkpoint] = {
    "qwen3": Checkpoint(QWEN3),
    "qwen3_tied_yarn": Checkpoint({**QWEN3, "tie_word_embeddings": True,
                                   "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                    "original_max_position_embeddings": 32}}),
    "qwen3_q4_mixed": Checkpoint(QWEN3, bits=4, predicate=mixed_bits),
}


def _all_rows() -> dict[str, Checkpoint]:
    """Every family's rows (each family keeps its own in tests/models/rows_<family>.py)."""
    from tests.models import rows_gemma3, rows_gpt_oss, rows_phi3, rows_qwen3_moe

    rows = dict(CHECKPOINTS)
    for module in (rows_gemma3, rows_phi3, rows_qwen3_moe, rows_gpt_oss):
        rows.update(module.ROWS)
    return rows


ALL = _all_rows()


def with_changes(base: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """`base` (a row's config) with `changes` applied; a change to None removes the key."""
    out = {**base, **changes}
    return {k: v for k, v in out.items() if changes.get(k, 0) is not None}


def refusal(cfg: dict[str, Any], source: str) -> str:
    """The one-line ConfigError `architectures.read_args` raises for `cfg` (it must raise one)."""
    import pytest

    from kvlayout.errors import ConfigError
    from kvlayout.models.architectures import read_args

    with pytest.raises(ConfigError) as refused:
        read_args(cfg, source)
    message = str(refused.value)
    assert "\n" not in message, message
    return message
