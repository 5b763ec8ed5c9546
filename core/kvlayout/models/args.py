"""What every architecture's config.json says that the rest of kvlayout reads: `ModelArgs`, and the
checked readers the families share.

The runner, the server, the cache config and tensor parallelism need only a
model's shape (layers, heads, head_dim, vocabulary), its per-layer windows
and its EOS ids; that is `ModelArgs`, the same for every family. What one
family alone reads (Qwen3-MoE's experts, Gemma 3's local RoPE base) is that
family's own frozen record in `extra`. Each family module reads its config
with `read_args(cfg, source)` (`kvlayout.models.architectures` picks the
module by `model_type`), building on the readers here, so a wrong value is
one ConfigError naming the file and the key, whatever the family.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from kvlayout.config import LayerConfig, LayerPolicy
from kvlayout.errors import ConfigError
from kvlayout.models import config_values as values


@attrs.frozen
class ModelArgs:
    """The fields of an HF `config.json` kvlayout itself reads, with HF's defaults."""

    model_type: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    # Per layer: 0 for full attention, else the sliding window (a ring layer).
    windows: tuple[int, ...] = ()
    eos_token_id: tuple[int, ...] = ()
    max_position_embeddings: int | None = None
    # The family's own checked fields (a frozen attrs record), None when it has none.
    extra: Any = None

    def layer_configs(self) -> tuple[LayerConfig, ...]:
        """The cache's per-layer shapes: sliding-window layers become ring layers."""
        return tuple(
            LayerConfig(
                self.num_key_value_heads,
                self.head_dim,
                LayerPolicy("ring", w) if w else LayerPolicy(),
            )
            for w in self.windows
        )


def read_shape(cfg: Mapping[str, Any], source: str, head_dim_key: bool = True) -> dict[str, Any]:
    """The shape fields every family has, checked: sizes, heads (GQA divides), head_dim (`head_dim_key`
    False: always hidden / heads, as Qwen2 and Phi-3 have it), vocabulary, norm eps, EOS ids."""
    hidden = values.integer(cfg, "hidden_size", source)
    n_heads = values.integer(cfg, "num_attention_heads", source)
    n_kv = values.integer(cfg, "num_key_value_heads", source, default=n_heads)
    if n_heads % n_kv:
        raise ConfigError(f"{source}: num_attention_heads={n_heads} is not a multiple of num_key_value_heads={n_kv}")
    head_dim = hidden // n_heads
    if head_dim_key:
        head_dim = values.integer(cfg, "head_dim", source, default=head_dim)
    if head_dim < 1:
        raise ConfigError(
            f"{source}: num_attention_heads={n_heads} is more than hidden_size={hidden}, "
            "so a head has no dimension; set head_dim"
        )
    return dict(
        hidden_size=hidden,
        num_hidden_layers=values.integer(cfg, "num_hidden_layers", source),
        intermediate_size=values.integer(cfg, "intermediate_size", source),
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv,
        vocab_size=values.integer(cfg, "vocab_size", source),
        head_dim=head_dim,
        rms_norm_eps=values.number(cfg, "rms_norm_eps", source, 1e-6),
        eos_token_id=values.token_ids(cfg.get("eos_token_id"), "eos_token_id", source),
        max_position_embeddings=values.integer(cfg, "max_position_embeddings", source, default=None),
    )


LAYER_TYPES = ("sliding_attention", "full_attention")


def layer_types(cfg: Mapping[str, Any], n_layers: int, source: str) -> tuple[str, ...] | None:
    """config.json's `layer_types`, checked (one known kind per layer); None when absent."""
    kinds = cfg.get("layer_types")
    if kinds is None:
        return None
    if not isinstance(kinds, list) or not all(isinstance(t, str) for t in kinds):
        raise ConfigError(f"{source}: layer_types={kinds!r}: expected a list of {' or '.join(map(repr, LAYER_TYPES))}")
    for i, kind in enumerate(kinds):
        if kind not in LAYER_TYPES:
            raise ConfigError(
                f"{source}: layer_types[{i}]={kind!r} is not a layer type kvlayout knows; "
                f"expected {' or '.join(map(repr, LAYER_TYPES))}"
            )
    if len(kinds) != n_layers:
        raise ConfigError(f"{source}: layer_types has {len(kinds)} entries, num_hidden_layers={n_layers}")
    return tuple(kinds)


def windows_of(kinds: Sequence[str], window: int) -> tuple[int, ...]:
    """Per layer, `window` for a sliding layer and 0 for a full one."""
    return tuple(window if kind == "sliding_attention" else 0 for kind in kinds)


def lift_rope_parameters(cfg: Mapping[str, Any], source: str) -> Mapping[str, Any]:
    """`cfg` with transformers 5's `rope_parameters` read where the families read RoPE settings.

    transformers 5 nests `rope_theta` and the scaling under `rope_parameters` (mlx-lm reads them
    there too), and Gemma 3's per layer type (`full_attention`, `sliding_attention`). A key given at
    the top level wins; a scaling of type "default" is no scaling. Without `rope_parameters`, `cfg`
    as it is.
    """
    params = cfg.get("rope_parameters")
    if params is None:
        return cfg
    if not isinstance(params, Mapping):
        raise ConfigError(f"{source}: rope_parameters={params!r}: expected an object (rope_type, rope_theta, ...)")
    out = dict(cfg)
    if "full_attention" in params or "sliding_attention" in params:  # Gemma 3: one per layer type
        local = params.get("sliding_attention") or {}
        if out.get("rope_local_base_freq") is None and isinstance(local, Mapping) and "rope_theta" in local:
            out["rope_local_base_freq"] = local["rope_theta"]
        params = params.get("full_attention") or {}
        if not isinstance(params, Mapping):
            raise ConfigError(f"{source}: rope_parameters.full_attention={params!r}: expected an object")
    if out.get("rope_theta") is None and "rope_theta" in params:
        out["rope_theta"] = params["rope_theta"]
    if out.get("rope_scaling") is None and rope_type(params) != "default":
        out["rope_scaling"] = {k: v for k, v in params.items() if k != "rope_theta"}
    return out


def rope_type(rope_scaling: Mapping[str, Any]) -> str:
    """HF spells it "type" in older configs, "rope_type" in newer ones."""
    return rope_scaling.get("type") or rope_scaling.get("rope_type", "default")


def rope_scaling(cfg: Mapping[str, Any], source: str, supported: Sequence[str],
                 needs: Mapping[str, Sequence[str]] = {}) -> dict | None:  # noqa: B006 (read only)
    """config.json's `rope_scaling`: null, or an object whose type is `supported` and which holds the
    keys `needs[type]` lists; anything else one ConfigError naming the key."""
    value = cfg.get("rope_scaling")
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ConfigError(f"{source}: rope_scaling={value!r}: expected null or an object with a rope_type")
    kind = rope_type(value)
    if kind not in supported:
        raise ConfigError(
            f"{source}: rope_scaling type {kind!r} is not supported; expected {', '.join(supported)}"
        )
    for key in needs.get(kind, ()):
        if key not in value:
            raise ConfigError(f"{source}: rope_scaling: missing key {key!r} (a {kind} rope_scaling needs it)")
    return dict(value)


def refuse_set(cfg: Mapping[str, Any], source: str, keys: Mapping[str, Any]) -> None:
    """A ConfigError naming the first of `keys` that config.json sets to something other than its
    harmless value (`keys[key]`; null and absent are harmless too): a feature kvlayout does not
    implement, refused rather than silently ignored."""
    for key, harmless in keys.items():
        value = cfg.get(key)
        if value is not None and value != harmless:
            raise ConfigError(
                f"{source}: {key}={value!r} is not supported by kvlayout's {cfg.get('model_type')} "
                f"(only {harmless!r} or null); the model would compute something else"
            )
