"""Gemma 3: sliding-window layers interleaved with global ones, two RoPE bases, four norms a block.

What differs from Llama, as mlx-lm's `gemma3_text` computes it:

- Layer kinds. mlx-lm reads only `sliding_window_pattern` (layer i is global iff
  `(i + 1) % pattern == 0`, default 6); newer HF configs also write `layer_types` (one kind per
  layer, which HF itself prefers) and `_sliding_window_pattern`. kvlayout reads `layer_types` when
  present and otherwise the pattern. When both are given and disagree, the config is refused
  (ConfigError naming `layer_types`): HF would run the layer_types and mlx-lm the pattern, two
  different models, and guessing which one the checkpoint was trained as is not ours to do. A
  sliding layer attends `sliding_window` keys (itself included), expressed by `ModelArgs.windows`.
- RoPE: sliding layers rotate with `rope_local_base_freq` and no scaling, global layers with
  `rope_theta` and `rope_scaling` (mlx-lm's `initialize_rope`, at per-token positions through
  `flat.RopeAt`). Only the scalings applied position by position are allowed ("dynamic" rescales by
  one sequence's length, which a flat step of many sequences does not have).
- Attention: per-head `q_norm` / `k_norm`, scale `query_pre_attn_scalar ** -0.5`.
- Gemma's RMSNorm (`rms_norm(x, 1 + weight)`), the gelu-tanh MLP and `clip_residual` are mlx-lm's
  own (`gemma3_text.RMSNorm`, `MLP`, `clip_residual`); the block (`GemmaBlock`) has four norms.
- Embeddings scaled by sqrt(hidden_size) rounded to bfloat16, as mlx-lm does.
- The head is tied unless the checkpoint holds `lm_head.weight` (mlx-lm's `sanitize` decides it
  from the tensors, and so does `sanitize` here).
- Logit soft-capping (`attn_logit_softcapping`, `final_logit_softcapping`, Gemma 2's) is not in
  mlx-lm's Gemma 3: refused when set.

`gemma3` (the multimodal model) runs its text half: the config's `text_config` (mlx-lm's
`gemma3.ModelArgs`: the top-level `vocab_size`, 8 / 4 heads by default), its tensors under
`language_model.` (`Gemma3`, the wrapper, keeps those names) and the vision tower dropped.

Defaults for absent keys are mlx-lm's where HF's Gemma3TextConfig agrees with them (head_dim,
query_pre_attn_scalar, the RoPE bases, the pattern, eps); where the two disagree (hidden and
intermediate sizes, the heads of `gemma3_text`, `sliding_window`, `gemma3_text`'s vocabulary) the
key is required, since either default would run a different model than the other reader.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import attrs
import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gemma3_text as mlx_lm_gemma3
from mlx_lm.models.rope_utils import initialize_rope

from kvlayout.errors import ConfigError
from kvlayout.models import config_values as values
from kvlayout.models.args import (
    ModelArgs,
    layer_types,
    lift_rope_parameters,
    read_shape,
    refuse_set,
    rope_scaling,
    rope_type,
    windows_of,
)
from kvlayout.models.flat import Attention, DecoderModel, RopeAt

MODEL_TYPES = ("gemma3_text", "gemma3")

# Absent (or null) keys read as mlx-lm's gemma3_text.ModelArgs and HF's Gemma3TextConfig both default them.
DEFAULTS = {"head_dim": 256, "num_hidden_layers": 26, "rms_norm_eps": 1e-6}
# mlx-lm's gemma3.ModelArgs: the multimodal config's text half (HF's defaults too).
MULTIMODAL_DEFAULTS = {"num_attention_heads": 8, "num_key_value_heads": 4}
MULTIMODAL_VOCAB = 262208
DEFAULT_PATTERN = 6
# Keys Gemma configs carry whose other values neither kvlayout nor mlx-lm's Gemma 3 computes.
UNSUPPORTED = {
    "attn_logit_softcapping": None,
    "final_logit_softcapping": None,
    "attention_bias": False,
    "hidden_activation": "gelu_pytorch_tanh",  # mlx-lm's MLP is gelu_approx, the tanh one
    "use_bidirectional_attention": False,
}
# The rope_scaling types mlx-lm's initialize_rope applies position by position, and the keys each needs.
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
ROPE_NEEDS = {"linear": ("factor",), "llama3": ("factor",), "yarn": ("factor",)}


@attrs.frozen
class Gemma:
    """Gemma 3's own config fields, checked."""

    query_pre_attn_scalar: float
    rope_local_base_freq: float


def read_args(cfg: Mapping[str, Any], source: str = "config.json") -> ModelArgs:
    """Read a Gemma 3 config (`gemma3_text`, or `gemma3`'s text half); one ConfigError naming the key."""
    model_type = cfg.get("model_type")
    if model_type == "gemma3":
        where = f"{source}: text_config"
        text = lift_rope_parameters(text_config(cfg, source), where)  # transformers 5 nests RoPE there too
        return attrs.evolve(read_text(text, where), model_type="gemma3")
    if model_type != "gemma3_text":
        raise ConfigError(
            f"{source}: model_type={model_type!r} is not supported; expected one of {', '.join(MODEL_TYPES)}"
        )
    for key in ("num_attention_heads", "num_key_value_heads", "vocab_size"):
        values.integer(cfg, key, source)  # required: mlx-lm's and HF's defaults disagree
    return read_text(cfg, source)


def text_config(cfg: Mapping[str, Any], source: str) -> dict[str, Any]:
    """The multimodal config's `text_config` as mlx-lm reads it: the vocabulary from the top level
    (refused when text_config says another), 8 / 4 heads by default, the top level's EOS ids."""
    text = cfg.get("text_config")
    if not isinstance(text, Mapping):
        raise ConfigError(f"{source}: text_config={text!r}: expected an object (the language model's config)")
    text = dict(text)
    top = values.integer(cfg, "vocab_size", source, default=None)
    inner = values.integer(text, "vocab_size", f"{source}: text_config", default=None)
    if top is not None and inner is not None and top != inner:
        raise ConfigError(
            f"{source}: vocab_size={top} but text_config.vocab_size={inner}; mlx-lm reads the first, "
            "Hugging Face the second: make them agree"
        )
    text["vocab_size"] = top or inner or MULTIMODAL_VOCAB
    for key, default in MULTIMODAL_DEFAULTS.items():
        if text.get(key) is None:
            text[key] = default
    if text.get("eos_token_id") is None:
        text["eos_token_id"] = cfg.get("eos_token_id")
    text.setdefault("model_type", "gemma3_text")
    return text


def read_text(cfg: Mapping[str, Any], source: str) -> ModelArgs:
    """The language model's config (a `gemma3_text` config, or a `gemma3` text_config), checked."""
    refuse_set(cfg, source, UNSUPPORTED)
    cfg = {**cfg, **{k: v for k, v in DEFAULTS.items() if cfg.get(k) is None}}
    shape = read_shape(cfg, source)
    window = values.integer(cfg, "sliding_window", source)  # required: mlx-lm's 512, HF's 4096
    return ModelArgs(
        model_type="gemma3_text",
        **shape,
        rope_theta=values.number(cfg, "rope_theta", source, 1000000.0),
        rope_scaling=read_rope_scaling(cfg, source),
        # HF ties by default; `sanitize` decides from the tensors, as mlx-lm does.
        tie_word_embeddings=values.boolean(cfg, "tie_word_embeddings", source, True),
        windows=windows_of(read_layer_types(cfg, shape["num_hidden_layers"], source), window),
        extra=Gemma(
            query_pre_attn_scalar=values.number(cfg, "query_pre_attn_scalar", source, 256.0),
            rope_local_base_freq=values.number(cfg, "rope_local_base_freq", source, 10000.0),
        ),
    )


def read_layer_types(cfg: Mapping[str, Any], n_layers: int, source: str) -> tuple[str, ...]:
    """Each layer's kind: `layer_types` when given (as HF), else from the pattern (as mlx-lm); both
    given and disagreeing is refused (the module docstring says why)."""
    pattern = read_pattern(cfg, source)
    by_pattern = tuple(
        "full_attention" if (i + 1) % (pattern or DEFAULT_PATTERN) == 0 else "sliding_attention"
        for i in range(n_layers)
    )
    kinds = layer_types(cfg, n_layers, source)
    if kinds is None:
        return by_pattern
    if pattern is not None and kinds != by_pattern:
        first = next(i for i, (a, b) in enumerate(zip(kinds, by_pattern)) if a != b)
        raise ConfigError(
            f"{source}: layer_types[{first}]={kinds[first]!r} disagrees with sliding_window_pattern={pattern} "
            f"(which makes layer {first} {by_pattern[first]!r}); Hugging Face runs the first, mlx-lm the "
            "second: remove one"
        )
    return kinds


def read_pattern(cfg: Mapping[str, Any], source: str) -> int | None:
    """`sliding_window_pattern` (newer HF configs write it `_sliding_window_pattern`), None when neither
    is given; both given must agree."""
    given = {key: values.integer(cfg, key, source, default=None)
             for key in ("sliding_window_pattern", "_sliding_window_pattern")}
    public, private = given.values()
    if public is not None and private is not None and public != private:
        raise ConfigError(f"{source}: sliding_window_pattern={public} but _sliding_window_pattern={private}; "
                          "make them agree")
    return public if public is not None else private


def read_rope_scaling(cfg: Mapping[str, Any], source: str) -> dict | None:
    """The global layers' `rope_scaling`, checked for what initialize_rope reads."""
    checked = rope_scaling(cfg, source, ROPE_TYPES, ROPE_NEEDS)
    if checked is None or rope_type(checked) == "default":
        return checked
    where = f"{source}: rope_scaling"
    values.positive_number(checked["factor"], "factor", where)
    if rope_type(checked) == "llama3":
        low = values.number(checked, "low_freq_factor", where, 1.0)
        high = values.number(checked, "high_freq_factor", where, 4.0)
        if high <= low:
            raise ConfigError(f"{where}: high_freq_factor={high} must be more than low_freq_factor={low}")
    if rope_type(checked) in ("llama3", "yarn"):
        values.integer(checked, "original_max_position_embeddings", where, default=None)
    return checked


def make_rope(args: ModelArgs, layer: int) -> RopeAt:
    """mlx-lm's RoPE for `layer`: the local base unscaled on a sliding layer, else rope_theta and
    rope_scaling; at per-token positions."""
    if args.windows[layer]:
        rope = initialize_rope(args.head_dim, base=args.extra.rope_local_base_freq, traditional=False)
    else:
        rope = initialize_rope(
            args.head_dim,
            base=args.rope_theta,
            traditional=False,
            scaling_config=args.rope_scaling,
            max_position_embeddings=args.max_position_embeddings,
        )
    return RopeAt(rope)


def attention(args: ModelArgs, layer: int) -> Attention:
    """mlx-lm's Gemma 3 attention on the flat step: heads normed by Gemma's `1 + weight` RMSNorm, the
    layer's own RoPE, scale query_pre_attn_scalar**-0.5 (the layer's window is the cache's)."""
    scale = args.extra.query_pre_attn_scalar**-0.5
    return Attention(args, layer, make_rope(args, layer), scale, norm=mlx_lm_gemma3.RMSNorm)


class GemmaBlock(nn.Module):
    """Gemma's sandwich block: each sublayer's input and output normed, the residual sums clipped in
    float16 (mlx-lm's clip_residual), under the checkpoint's names."""

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, hidden: int, eps: float):
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = mlx_lm_gemma3.RMSNorm(hidden, eps=eps)
        self.post_attention_layernorm = mlx_lm_gemma3.RMSNorm(hidden, eps=eps)
        self.pre_feedforward_layernorm = mlx_lm_gemma3.RMSNorm(hidden, eps=eps)
        self.post_feedforward_layernorm = mlx_lm_gemma3.RMSNorm(hidden, eps=eps)

    def __call__(self, x, positions, pos_host, cache):
        r = self.self_attn(self.input_layernorm(x), positions, pos_host, cache)
        h = mlx_lm_gemma3.clip_residual(x, self.post_attention_layernorm(r))
        r = self.mlp(self.pre_feedforward_layernorm(h))
        return mlx_lm_gemma3.clip_residual(h, self.post_feedforward_layernorm(r))


def scale_embeddings(hidden: int, h: mx.array) -> mx.array:
    """h * sqrt(hidden), the factor rounded to bfloat16 first, exactly as mlx-lm (and HF) scale it."""
    return h * mx.array(hidden**0.5, mx.bfloat16).astype(h.dtype)


def build_text(args: ModelArgs) -> DecoderModel:
    """The language model (names as in a gemma3_text checkpoint), with fresh weights."""
    layers = [
        GemmaBlock(attention(args, i), mlx_lm_gemma3.MLP(args.hidden_size, args.intermediate_size),
                   args.hidden_size, args.rms_norm_eps)
        for i in range(args.num_hidden_layers)
    ]
    norm = mlx_lm_gemma3.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
    return DecoderModel(args, layers, norm, embed_scale=functools.partial(scale_embeddings, args.hidden_size))


class Gemma3(nn.Module):
    """The multimodal gemma3's text half, as its checkpoint names it: the language model under
    `language_model.` (so tensor names and a quantization section's module paths match)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.language_model = build_text(args)

    @property
    def model(self) -> nn.Module:
        """The backbone (`model.model.layers`), as on every family's model."""
        return self.language_model.model

    @property
    def dtype(self) -> mx.Dtype:
        return self.language_model.dtype

    def __call__(self, tokens, positions, cache, rows=None) -> mx.array:
        return self.language_model(tokens, positions, cache, rows)


def build(args: ModelArgs) -> nn.Module:
    """The model `args` describes, with fresh (random) weights."""
    return Gemma3(args) if args.model_type == "gemma3" else build_text(args)


def sanitize(args: ModelArgs, weights: dict, source: str) -> tuple[ModelArgs, dict]:
    """As mlx-lm's sanitize: the head tied unless the checkpoint holds one; a multimodal checkpoint's
    vision tower and projector dropped (kvlayout runs the text half)."""
    prefix = "language_model." if args.model_type == "gemma3" else ""
    if prefix:
        weights = {k: v for k, v in weights.items()
                   if not k.startswith(("vision_tower.", "multi_modal_projector."))}
    tied = f"{prefix}lm_head.weight" not in weights
    return attrs.evolve(args, tie_word_embeddings=tied), weights
