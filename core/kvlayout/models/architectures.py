"""Which module reads and builds each `model_type`: one small module per family, one row here.

A family module has `MODEL_TYPES`, `read_args(cfg, source) -> ModelArgs` (a
bad or unimplemented value is one ConfigError naming the key) and
`build(args)` (the model, random weights); optionally `sanitize(args,
weights) -> (args, weights)`, what its checkpoints need before the tensors
are checked (drop a vision tower, read tying from the tensors), and
`shard(model, group)` / `check_shard(model, ranks, source)` where it runs
tensor parallel another way than the Llama block (`kvlayout.models.shard`).
Modules are imported when a model of theirs is loaded: the families built
on mlx-lm's blocks import mlx-lm (and transformers behind it, ~1.7 s), which
a Llama run never pays.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from types import ModuleType
from typing import Any

from kvlayout.errors import ConfigError
from kvlayout.models.args import lift_rope_parameters

FAMILIES = {
    "llama": "kvlayout.models.llama",
    "mistral": "kvlayout.models.llama",
    "qwen2": "kvlayout.models.llama",
    "qwen3": "kvlayout.models.qwen3",
    "qwen3_moe": "kvlayout.models.qwen3_moe",
    "gemma3_text": "kvlayout.models.gemma3",
    "gemma3": "kvlayout.models.gemma3",
    "phi3": "kvlayout.models.phi3",
    "gpt_oss": "kvlayout.models.gpt_oss",
}
MODEL_TYPES = tuple(FAMILIES)


def family(model_type: Any, source: str = "config.json") -> ModuleType:
    """The module of `model_type`, or a ConfigError naming the types kvlayout runs."""
    name = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if name is None:
        raise ConfigError(
            f"{source}: model_type={model_type!r} is not supported; expected one of {', '.join(MODEL_TYPES)}"
        )
    return importlib.import_module(name)


def read_args(cfg: Mapping[str, Any], source: str = "config.json"):
    """The config dict's ModelArgs, read by its family's module (transformers 5's `rope_parameters`
    read where the older keys are: `args.lift_rope_parameters`)."""
    module = family(cfg.get("model_type"), source)
    return module.read_args(lift_rope_parameters(cfg, source), source)


def build_model(args):
    """The model `args` describes, with fresh weights."""
    return family(args.model_type).build(args)


def sanitize(args, weights: dict, source: str):
    """(args, weights) as the family needs them before the tensors are checked (as read otherwise)."""
    fix = getattr(family(args.model_type), "sanitize", None)
    return (args, weights) if fix is None else fix(args, weights, source)
