"""How a model directory's weights are packed: the `quantization` section of config.json.

`mlx_lm.convert -q` (and kvlayout's GGUF import) store a Linear or Embedding
weight MLX-quantized: `weight` packed into uint32 words, plus one float
`scales` and `biases` per group of inputs, under the module's own name.
config.json says how:

    "quantization": {"group_size": 64, "bits": 4, "mode": "affine",
                     "model.embed_tokens": {"group_size": 32, "bits": 8},
                     "lm_head": false}

The top level is the default packing; a module path maps to its own, or to
false to keep that module in floats. mlx-lm copies the section to
`quantization_config` (the key Hugging Face tools look for); that copy is read
only when `quantization` is absent.

Which modules are packed follows mlx-lm's loader: a module the section names,
as it says; any other Linear or Embedding whose `scales` are in the
checkpoint, by the default (convert leaves a layer whose input does not split
into whole groups in floats, and writes nothing about it). Unlike mlx-lm,
which infers an unnamed module's bits from its tensors' shapes, the declared
packing is taken at its word and the tensors are then checked against it
(`loading.check_weights`), so a checkpoint that disagrees with its config is
refused naming the tensor, never read another way.

Mixture-of-experts layers are mlx-lm's `SwitchLinear` (every expert's weight stacked
`[experts, out, in]`), packed into its `QuantizedSwitchLinear` as mlx-lm packs them
(words `[experts, out, in * bits / 32]`). Those classes are looked up only when
mlx-lm's `switch_layers` is already imported: a model that holds one was built by a
family that imported it, and a Llama run never pays for importing mlx-lm.

Two modes: "affine" (a float scale and bias per group) and "mxfp4" (gpt-oss's
mlx-community packing: 4-bit floats in groups of 32, one uint8 power-of-two scale
per group, no biases). A per-module entry without a mode is affine, as mlx-lm
reads it (`to_quantized`'s default).

`dequantize_model` undoes the packing in memory, as `mlx_lm.convert --dequantize`
does on disk: MLX's CPU backend multiplies packed weights about linearly in
the tokens of a step, while float32 ones go through BLAS (the run decides
when: `runner.job.dequantize_as_configured`).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Collection, Mapping
from typing import Any

import attrs
import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from kvlayout.checks import int_scalar, reject_unknown
from kvlayout.errors import ConfigError

# What mx.quantize accepts in affine mode (mlx 0.32); tests/models/test_quantization_config.py
# asks MLX itself, so a change in MLX fails there rather than refusing good directories.
AFFINE_BITS = (1, 2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)
# The other mode mlx-lm writes that kvlayout loads: mx.quantize takes mxfp4 with groups of 32 and 4 bits only.
MXFP4 = {"group_size": 32, "bits": 4}
MODES = ("affine", "mxfp4")
KEYS = ("group_size", "bits", "mode")


@attrs.frozen
class Packing:
    """How one module's weight is packed (keyword arguments of `to_quantized`)."""

    group_size: int
    bits: int
    mode: str = "affine"


@attrs.frozen
class Quantization:
    """A checked quantization section: the default, and per-module packings (None: left in floats)."""

    default: Packing
    modules: dict[str, Packing | None]
    key: str  # "quantization" or "quantization_config": what a later error names


def read_quantization(cfg: Mapping[str, Any], source: str) -> Quantization | None:
    """The section of an HF config dict, checked; None when the weights are not quantized.

    Every bad value is a ConfigError naming `source` (config.json) and the key.
    """
    key = "quantization" if cfg.get("quantization") is not None else "quantization_config"
    section = cfg.get(key)
    if section is None:
        return None
    if not isinstance(section, Mapping):
        raise ConfigError(f"{source}: {key}: expected a mapping (group_size, bits), got {type(section).__name__}")
    if "quant_method" in section:
        # Hugging Face's own quantized formats (AWQ, GPTQ, bitsandbytes, fp8...) pack differently.
        raise ConfigError(
            f"{source}: {key}.quant_method={section['quant_method']!r} is not supported; kvlayout loads "
            "MLX-quantized directories (write one with `mlx_lm.convert -q`)"
        )
    default = _packing({k: v for k, v in section.items() if k in KEYS}, key, source)
    modules: dict[str, Packing | None] = {}
    for path, value in section.items():
        if path in KEYS:
            continue
        where = _entry(key, path)
        if isinstance(value, bool):
            modules[path] = default if value else None
        elif isinstance(value, Mapping):
            modules[path] = _packing(value, where, source)
        else:
            raise ConfigError(
                f"{source}: {where}={value!r}: expected a module path mapped to {{group_size, bits}} or false "
                f"(the section's own keys are {', '.join(KEYS)})"
            )
    return Quantization(default, modules, key)


def _entry(key: str, path: str) -> str:
    """A module's entry as config.json spells it: quantization["model.embed_tokens"]."""
    return f"{key}[{json.dumps(path)}]"


def _packing(data: Mapping[str, Any], where: str, source: str) -> Packing:
    reject_unknown(data, KEYS, source, prefix=where, required=("group_size", "bits"))
    mode = data.get("mode", "affine")
    if mode not in MODES:
        raise ConfigError(
            f"{source}: {where}.mode={mode!r} is not supported; kvlayout loads {' or '.join(MODES)} quantization"
        )
    bits = int_scalar(f"{source}: {where}.bits", data["bits"], ConfigError, numpy=False)
    group_size = int_scalar(f"{source}: {where}.group_size", data["group_size"], ConfigError, numpy=False)
    if mode == "mxfp4":
        for key, want in MXFP4.items():
            got = {"bits": bits, "group_size": group_size}[key]
            if got != want:
                raise ConfigError(f"{source}: {where}.{key}={got}: mode 'mxfp4' packs with {key}={want} only")
        return Packing(group_size, bits, mode)
    if bits not in AFFINE_BITS:
        raise ConfigError(f"{source}: {where}.bits={bits}: MLX packs {_either(AFFINE_BITS)} bits")
    if group_size not in GROUP_SIZES:
        raise ConfigError(
            f"{source}: {where}.group_size={group_size}: MLX packs groups of {_either(GROUP_SIZES)} inputs"
        )
    return Packing(group_size, bits, mode)


def _either(values: tuple[int, ...]) -> str:
    return ", ".join(map(str, values[:-1])) + f" or {values[-1]}"


def switch_classes() -> tuple[type, type] | tuple[()]:
    """mlx-lm's (SwitchLinear, QuantizedSwitchLinear) when its switch_layers is imported, else ().

    A model can hold one only if the module was imported to build it, so
    looking in sys.modules never imports mlx-lm (~1.7 s) for a model without experts.
    """
    switch = sys.modules.get("mlx_lm.models.switch_layers")
    return () if switch is None else (switch.SwitchLinear, switch.QuantizedSwitchLinear)


def quantize(model: nn.Module, quant: Quantization, names: Collection[str], source: str) -> None:
    """Swap `model`'s Linear, Embedding and expert (mlx-lm's SwitchLinear) layers for their quantized
    forms, in place.

    `names` are the checkpoint's tensor names (a module with `scales` there is
    packed by the default). Every refusal comes before the model is touched.
    """
    kinds = (nn.Linear, nn.Embedding, *switch_classes()[:1])
    packable = {p: m for p, m in model.named_modules() if isinstance(m, kinds)}
    for path in quant.modules:
        if path not in packable:
            raise ConfigError(f"{source}: {_entry(quant.key, path)} names no Linear or Embedding of this model")
    chosen: dict[str, Packing] = {}
    for path, module in packable.items():
        named = path in quant.modules
        packing = quant.modules[path] if named else quant.default if f"{path}.scales" in names else None
        if packing is None:
            continue
        # Linear [out, in], Embedding [vocab, dims], experts [E, out, in]: groups run along the last axis
        in_dims = module.weight.shape[-1]
        if in_dims % packing.group_size:
            where = _entry(quant.key, path) if named else quant.key
            raise ConfigError(
                f"{source}: {where}.group_size={packing.group_size} does not divide the input dimension "
                f"{in_dims} of {path}"
            )
        chosen[path] = packing
    nn.quantize(model, class_predicate=lambda path, _: attrs.asdict(chosen[path]) if path in chosen else False)


PACKED = (nn.QuantizedLinear, nn.QuantizedEmbedding)


def packed_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The model's quantized Linear, Embedding and expert layers by path ({} when it holds none)."""
    kinds = PACKED + switch_classes()[1:]
    return {path: m for path, m in model.named_modules() if isinstance(m, kinds)}


def packed_bits(model: nn.Module) -> str:
    """How the model's layers are packed, for a person: "4-bit", "4/8-bit" ("" when none are)."""
    bits = sorted({m.bits for m in packed_modules(model).values()})
    return "/".join(map(str, bits)) + "-bit" if bits else ""


def dequantized_nbytes(model: nn.Module, dtype: mx.Dtype) -> int:
    """Bytes the model's parameters would take once `dequantize_model(model, dtype)` has run: every float
    in `dtype`, a packed weight unpacked (its scales and biases gone), anything else as it is."""
    packed = packed_modules(model)
    total = 0
    for name, p in tree_flatten(model.parameters()):
        owner, _, leaf = name.rpartition(".")
        if owner in packed and leaf in ("scales", "biases"):
            continue
        if owner in packed and leaf == "weight":  # [.., out, in * bits / 32] words -> [.., out, in] floats
            total += p.size * 32 // packed[owner].bits * dtype.size
        elif mx.issubdtype(p.dtype, mx.floating):
            total += p.size * dtype.size
        else:
            total += p.nbytes
    return total


def dequantize_model(model: nn.Module, dtype: mx.Dtype) -> None:
    """Unpack every quantized layer of `model` into a float Linear, Embedding or SwitchLinear (mlx-lm's
    experts, their bias kept) of `dtype`, in place.

    Bit for bit what `mlx_lm.convert --dequantize --dtype D` writes: every
    float parameter (scales and biases included) is cast to `dtype` first,
    then `mx.dequantize` unpacks the words with those scales and biases. A
    tied head keeps working (an Embedding's `as_linear`). The new weights are
    evaluated before returning, so the packed ones can be freed.
    """
    model.set_dtype(dtype)  # floats only: the packed uint32 words (and mxfp4's uint8 scales) stay as they are
    unpacked = []
    for path, m in packed_modules(model).items():
        # `dtype` given: mxfp4's uint8 scales would otherwise unpack into bfloat16 (affine's are `dtype` already).
        weight = mx.dequantize(m.weight, m.scales, m.get("biases"), m.group_size, m.bits, m.mode,
                               dtype=dtype)  # [.., out, in]
        layer = _float_layer(m, weight)
        layer.weight = weight  # the layer's own random init is lazy, never computed
        if "bias" in m:
            layer.bias = m.bias
        unpacked.append((path, layer))
    model.update_modules(tree_unflatten(unpacked))
    mx.eval(model.parameters())


def _float_layer(m: nn.Module, weight: mx.array) -> nn.Module:
    """The float layer a packed one came from, shaped as its unpacked `weight` (bias when it has one)."""
    if isinstance(m, nn.QuantizedLinear):
        return nn.Linear(weight.shape[1], weight.shape[0], bias="bias" in m)
    if isinstance(m, nn.QuantizedEmbedding):
        return nn.Embedding(weight.shape[0], weight.shape[1])
    switch_linear = switch_classes()[0]  # the module is imported: `m` is one of its layers
    experts, out_dims, in_dims = weight.shape  # [E, out, in]
    return switch_linear(in_dims, out_dims, experts, bias="bias" in m)
