"""Load (and write) a model directory in the Hugging Face layout.

A directory holds `config.json` and one or more `*.safetensors` files (a
sharded checkpoint is just several); tensors keep their HF names. An
MLX-quantized directory (`mlx_lm.convert -q`) says so in config.json's
`quantization` section (`kvlayout.models.quantization`). Every failure is a
ConfigError naming the file or the tensor and what to do.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from kvlayout.errors import ConfigError
from kvlayout.mlx.pool import DTYPES
from kvlayout.models import architectures
from kvlayout.models.files import read_json_object
from kvlayout.models.quantization import quantize, read_quantization, switch_classes
from kvlayout.models.tokenizer import load_tokenizer


def read_config(model_dir: Path) -> dict[str, Any]:
    """The directory's config.json as a dict; ConfigError when the directory or the file is not one."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        problem = "is not a directory" if model_dir.exists() else "does not exist"
        raise ConfigError(
            f"model directory {str(model_dir)!r} {problem}; set [model] path to a Hugging Face "
            "model directory, or create one with `kvlayout init-model DIR --preset tiny`"
        )
    path = model_dir / "config.json"
    if not path.exists():
        raise ConfigError(f"{path}: missing; a model directory needs config.json and *.safetensors")
    return read_json_object(path)


def read_weights(model_dir: Path) -> dict[str, mx.array]:
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        needs = f"{model_dir}: no *.safetensors file; a model directory needs its weights"
        raise ConfigError(needs + _pickled(model_dir))
    weights: dict[str, mx.array] = {}
    for f in files:
        try:
            shard = mx.load(str(f))
        except Exception as exc:  # mlx raises plain RuntimeError/ValueError on a bad file
            raise ConfigError(f"{f}: cannot read safetensors ({exc})") from exc
        for name in shard.keys() & weights.keys():
            raise ConfigError(f"{f}: tensor {name!r} also appears in another shard")
        weights.update(shard)
    return weights


# PyTorch's pickled checkpoints (torch.save): unpickling runs code from the file and needs torch, so they are
# not read. mlx_lm.convert cannot help either (it reads only *.safetensors); transformers converts them.
PICKLED = ("*.bin", "*.pt", "*.pth")


def _pickled(model_dir: Path) -> str:
    """Where the weights are there but pickled: that they are not read, and how to convert them."""
    found = sorted(p.name for pattern in PICKLED for p in Path(model_dir).glob(pattern))
    if not found:
        return ""
    more = f" and {len(found) - 1} more" if len(found) > 1 else ""
    d = str(model_dir)
    return (
        f"; {found[0]}{more} found, but PyTorch .bin/.pt/.pth files are not read: convert them with transformers, "
        f"AutoModelForCausalLM.from_pretrained({d!r}).save_pretrained({d!r}, safe_serialization=True)"
    )


def check_weights(model, weights: Mapping[str, mx.array], source: str) -> dict[str, mx.array]:
    """The checkpoint's tensors, exactly the model's parameters, or a ConfigError naming one.

    A quantized model's parameters are its packed ones (uint32 `weight`, float
    `scales` and `biases`), so a packed tensor is checked like any other.
    """
    weights = {k: v for k, v in weights.items() if "rotary_emb.inv_freq" not in k}  # precomputed, unused
    if model.args.tie_word_embeddings:
        weights.pop("lm_head.weight", None)  # some tied checkpoints store the copy anyway
    expected = dict(tree_flatten(model.parameters()))
    missing = sorted(expected.keys() - weights.keys())
    if missing:
        raise ConfigError(f"{source}: missing {tensors_named(missing)}; the checkpoint does not match config.json")
    unexpected = sorted(weights.keys() - expected.keys())
    if unexpected:
        why = "the checkpoint does not match config.json"
        if any(n.endswith(".scales") for n in unexpected) and not any(n.endswith(".scales") for n in expected):
            why = "the checkpoint is quantized but config.json has no quantization section"
        raise ConfigError(f"{source}: unexpected {tensors_named(unexpected)}; {why}")
    modules = dict(model.named_modules())
    for name, param in expected.items():
        got = weights[name]
        packed = _packing_of(modules.get(name.rpartition(".")[0]))
        if tuple(got.shape) != tuple(param.shape):
            raise ConfigError(
                f"{source}: tensor {name!r} has shape {tuple(got.shape)}, "
                f"config.json implies {tuple(param.shape)}{packed}"
            )
        # Floats may differ (they are cast); a packed weight must be the integer words it claims to be.
        if got.dtype != param.dtype and not (_is_float(got) and _is_float(param)):
            raise ConfigError(
                f"{source}: tensor {name!r} is {_name(got.dtype)}, config.json implies {_name(param.dtype)}{packed}"
            )
    return weights


def tensors_named(names: Sequence[str]) -> str:
    """"tensor 'first' (and N more)": the first of `names` (in the caller's order) and how many follow."""
    more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
    return f"tensor {names[0]!r}{more}"


def _packing_of(module) -> str:
    """How config.json says a module is packed, for an error message ("" when it is not)."""
    if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        return f" (packed {module.bits}-bit in groups of {module.group_size}, as its quantization section says)"
    return ""


def _is_float(a: mx.array) -> bool:
    return mx.issubdtype(a.dtype, mx.floating)


def _name(dtype: mx.Dtype) -> str:
    return str(dtype).removeprefix("mlx.core.")


def load_model(model_dir: Path, dtype: str | None = None):
    """(model, args, tokenizer) from an HF directory; `dtype` casts the weights (None: as stored).

    A quantized directory's layers are swapped for their quantized forms
    before the tensors are checked, so the check sees the packed shapes (the
    run unpacks them afterwards where [model] dequantize says so:
    `quantization.dequantize_model`, `runner.job.dequantize_as_configured`).
    """
    model_dir = Path(model_dir)
    cfg, source = read_config(model_dir), str(model_dir / "config.json")
    args = architectures.read_args(cfg, source=source)
    quant = read_quantization(cfg, source)
    args, weights = architectures.sanitize(args, read_weights(model_dir), str(model_dir))
    model = architectures.build_model(args)
    if quant is not None:
        quantize(model, quant, weights.keys(), source)
    weights = check_weights(model, weights, str(model_dir))
    if dtype is not None:
        # Only floats take the dtype: a packed (quantized) weight's uint32 words must stay as they are.
        weights = {k: v.astype(DTYPES[dtype]) if _is_float(v) else v for k, v in weights.items()}
    model.load_weights(list(weights.items()), strict=True)
    check_experts_dtype(model, str(model_dir))
    mx.eval(model.parameters())
    return model, args, load_tokenizer(model_dir, args.eos_token_id, args.vocab_size)


def check_experts_dtype(model, source: str) -> None:
    """ConfigError when float experts (a mixture of experts' SwitchLinear) are in half precision on the CPU:
    MLX's gather_mm, which multiplies them, runs float32 only there ("Currently only supports float32"),
    so the first step would fail with MLX's own error. Quantized experts (gather_qmm) run in any dtype."""
    switch = switch_classes()[:1]
    if not switch or mx.default_device() != mx.cpu:
        return
    for path, m in model.named_modules():
        if isinstance(m, switch) and m.weight.dtype != mx.float32:
            raise ConfigError(
                f"{source}: {path} holds float experts in {_name(m.weight.dtype)}, which MLX multiplies on the "
                'CPU in float32 only; set [model] dtype = "float32" (or use a quantized checkpoint)'
            )


def save_model(model_dir: Path, hf_config: Mapping[str, Any], weights: Mapping[str, mx.array]) -> None:
    """Write config.json and model.safetensors under their HF names."""
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(dict(hf_config), indent=2) + "\n")
    mx.save_safetensors(str(model_dir / "model.safetensors"), dict(weights), metadata={"format": "pt"})
