"""Tensor parallelism: the model split across the ranks of a group, as mlx-lm's `model.shard(group)` splits it.

Each rank keeps 1/N of every layer's attention heads and MLP columns:
q/k/v and gate/up are "all-to-sharded" (each rank computes its own heads'
and columns' outputs from the whole hidden state), o_proj and down_proj
"sharded-to-all" (each rank's part of the product, summed over the group
with one all_sum per projection). Embeddings, norms and the LM head stay
whole on every rank, so the hidden state after each layer, and the logits,
are the same everywhere. Rank r holds query heads [r H/N, (r+1) H/N) and KV
heads [r H_kv/N, (r+1) H_kv/N): the KV heads its query heads read (GQA),
so each rank's cache holds only its own heads' K/V.
"""

from __future__ import annotations

from typing import Any

import attrs
import mlx.core as mx
from mlx.nn.layers.distributed import shard_linear
from mlx.utils import tree_flatten

from kvlayout.errors import ConfigError


def check_shardable(args: Any, ranks: int, source: str, model: Any = None) -> None:
    """ConfigError naming the field when `args` (ModelArgs) does not split over `ranks` ranks, or
    when a quantized projection of `model` would split inside one of its groups."""
    fields = ("num_key_value_heads", "num_attention_heads", "intermediate_size")
    for field in fields:
        value = getattr(args, field)
        if value % ranks:
            fits = [n for n in range(2, value + 1) if all(getattr(args, f) % n == 0 for f in fields)]
            hint = f"run it on {' or '.join(map(str, fits[:4]))} ranks" if fits else "run it in one process"
            raise ConfigError(f"{source}: {field}={value} does not divide among {ranks} ranks; {hint}")
    if model is None:
        return
    # A sharded-to-all projection splits its inputs: each rank's share must be whole groups.
    for i, layer in enumerate(model.model.layers):
        for name, proj in (("self_attn.o_proj", layer.self_attn.o_proj), ("mlp.down_proj", layer.mlp.down_proj)):
            group = getattr(proj, "group_size", None)
            if group is None:
                continue
            inputs = proj.weight.shape[-1] * 32 // proj.bits  # packed words back to elements
            if (inputs // ranks) % group:
                raise ConfigError(
                    f"{source}: layer {i} {name} has {inputs} inputs quantized in groups of {group}: "
                    f"{ranks} ranks would split a group ({inputs // ranks} inputs each); run it on fewer ranks"
                )


def local_args(args: Any, ranks: int) -> Any:
    """`args` as one rank's share sees it: its heads (what its cache holds) and MLP columns."""
    return attrs.evolve(
        args,
        num_attention_heads=args.num_attention_heads // ranks,
        num_key_value_heads=args.num_key_value_heads // ranks,
        intermediate_size=args.intermediate_size // ranks,
    )


def shards_of(model: Any) -> int:
    """The ranks `model` is split over (1: whole), read from its first query projection."""
    group = getattr(model.model.layers[0].self_attn.q_proj, "group", None) if model.model.layers else None
    return 1 if group is None else group.size()


def shard_model(model: Any, group: Any) -> None:
    """Split `model` (kvlayout.models.llama.Model) in place over `group` (`check_shardable` first).
    Quantized projections split as they are (mlx's Quantized*Linear), never dequantized."""
    n = group.size()
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.q_proj = shard_linear(attn.q_proj, "all-to-sharded", group=group)
        attn.k_proj = shard_linear(attn.k_proj, "all-to-sharded", group=group)
        attn.v_proj = shard_linear(attn.v_proj, "all-to-sharded", group=group)
        attn.o_proj = shard_linear(attn.o_proj, "sharded-to-all", group=group)
        attn.n_heads //= n
        attn.n_kv_heads //= n
        mlp.gate_proj = shard_linear(mlp.gate_proj, "all-to-sharded", group=group)
        mlp.up_proj = shard_linear(mlp.up_proj, "all-to-sharded", group=group)
        mlp.down_proj = shard_linear(mlp.down_proj, "sharded-to-all", group=group)
    mx.eval(model.parameters())  # the whole weights go as soon as nothing holds them


def model_bytes(model: Any) -> int:
    """Bytes of the model's parameters in this process."""
    return sum(p.nbytes for _, p in tree_flatten(model.parameters()))
