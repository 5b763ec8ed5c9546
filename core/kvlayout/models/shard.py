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
from mlx.nn.layers.distributed import shard_inplace, shard_linear
from mlx.utils import tree_flatten

from kvlayout.errors import ConfigError

# (module path in a layer, sharding): "all-to-sharded" splits a projection's outputs (each rank its own
# heads or columns), "sharded-to-all" its inputs (each rank's part of the product, summed over the group).
DENSE = (("self_attn.q_proj", "all-to-sharded"), ("self_attn.k_proj", "all-to-sharded"),
         ("self_attn.v_proj", "all-to-sharded"), ("self_attn.o_proj", "sharded-to-all"),
         ("mlp.gate_proj", "all-to-sharded"), ("mlp.up_proj", "all-to-sharded"), ("mlp.down_proj", "sharded-to-all"))
# A mixture of experts (mlx-lm's SwitchGLU under `switch_mlp` (Qwen3-MoE) or `experts` (gpt-oss)): every
# expert split alike, in place; the router stays whole and the block sums its output over the group.
EXPERTS = (("gate_proj", "all-to-sharded"), ("up_proj", "all-to-sharded"), ("down_proj", "sharded-to-all"))


def layers_of(model: Any) -> list:
    """The decoder layers of any family's model (`model.model.layers`)."""
    return list(model.model.layers)


def experts_of(mlp: Any) -> Any:
    """The MLP's switch layer (its experts), None for a dense MLP."""
    for name in ("switch_mlp", "experts"):
        if name in mlp:
            return mlp[name]
    return None


def projections(layer: Any) -> list[tuple[str, Any, str]]:
    """(path, module, sharding) of every projection tensor parallelism splits in `layer`."""
    modules = dict(layer.named_modules())
    found = [(path, modules[path], how) for path, how in DENSE if path in modules]
    experts = experts_of(layer.mlp)
    if experts is not None:
        prefix = "mlp.switch_mlp" if "switch_mlp" in layer.mlp else "mlp.experts"
        found += [(f"{prefix}.{name}", experts[name], how) for name, how in EXPERTS]
    return found


def check_shardable(args: Any, ranks: int, source: str, model: Any = None) -> None:
    """ConfigError naming the field when `args` (ModelArgs) does not split over `ranks` ranks; with
    `model`, naming the layer when a projection does not split (a fused one, an expert's columns, a
    quantized projection split inside one of its groups)."""
    fields = ("num_key_value_heads", "num_attention_heads", "intermediate_size")
    for field in fields:
        value = getattr(args, field)
        if value % ranks:
            fits = [n for n in range(2, value + 1) if all(getattr(args, f) % n == 0 for f in fields)]
            hint = f"run it on {' or '.join(map(str, fits[:4]))} ranks" if fits else "run it in one process"
            raise ConfigError(f"{source}: {field}={value} does not divide among {ranks} ranks; {hint}")
    if model is None:
        return
    for i, layer in enumerate(layers_of(model)):
        for fused in ("qkv_proj", "gate_up_proj"):
            if fused in layer.self_attn or fused in layer.mlp:
                raise ConfigError(
                    f"{source}: layer {i} has a fused {fused}, which kvlayout does not split over ranks; "
                    "run this model in one process"
                )
        for path, proj, how in projections(layer):
            _check_split(proj, how, ranks, f"{source}: layer {i} {path}")


def _check_split(proj: Any, how: str, ranks: int, where: str) -> None:
    """A projection's split axis must divide among the ranks, and a quantized one's inputs into whole groups."""
    group = getattr(proj, "group_size", None)
    inputs = proj.weight.shape[-1] * (32 // proj.bits if group is not None else 1)  # packed words back to elements
    outputs = proj.weight.shape[-2]
    size = outputs if how == "all-to-sharded" else inputs
    if size % ranks:
        raise ConfigError(f"{where} has {size} {'outputs' if how == 'all-to-sharded' else 'inputs'}, "
                          f"which do not divide among {ranks} ranks; run it on fewer ranks")
    if how == "sharded-to-all" and group is not None and (inputs // ranks) % group:
        raise ConfigError(
            f"{where} has {inputs} inputs quantized in groups of {group}: "
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
    layers = layers_of(model)
    group = getattr(layers[0].self_attn.q_proj, "group", None) if layers else None
    return 1 if group is None else group.size()


def shard_model(model: Any, group: Any) -> None:
    """Split `model` (any family's) in place over `group` (`check_shardable` first), as mlx-lm's
    `model.shard(group)` does. Quantized projections split as they are (mlx's Quantized*Linear,
    mlx-lm's QuantizedSwitchLinear), never dequantized."""
    n, rank = group.size(), group.rank()
    for layer in layers_of(model):
        attn, experts = layer.self_attn, experts_of(layer.mlp)
        modules = dict(layer.named_modules())
        for path, proj, how in projections(layer):
            owner_path, _, name = path.rpartition(".")
            if experts is not None and modules[owner_path] is experts:
                shard_inplace(proj, how, group=group)
                if how == "sharded-to-all" and "bias" in proj:
                    proj.bias = proj.bias / n  # summed over the ranks: each adds its share (as mlx-lm's gpt-oss)
            else:  # a new (sharded) module in the old one's place
                setattr(modules[owner_path], name, shard_linear(proj, how, group=group))
        attn.n_heads //= n
        attn.n_kv_heads //= n
        if "sinks" in attn:  # one learned logit per query head: each rank keeps its heads'
            attn.sinks = attn.sinks[rank * attn.n_heads : (rank + 1) * attn.n_heads]
        if experts is not None:
            layer.mlp.sharding_group = group  # mlx-lm's MoE blocks sum their output over it
    mx.eval(model.parameters())  # the whole weights go as soon as nothing holds them


def model_bytes(model: Any) -> int:
    """Bytes of the model's parameters in this process."""
    return sum(p.nbytes for _, p in tree_flatten(model.parameters()))
