"""Quantized model directories written by mlx-lm, and mlx-lm's greedy tokens on them (the oracle).

`mlx_lm.convert` loads a tokenizer before it converts anything, and the tiny
preset has none (kvlayout reads bytes): `convert_tiny` gives the preset a
two-word `tokenizer.json` first, so the directory is written by mlx-lm's own
convert path. Requests then use `prompt_ids`, never text.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx_lm.utils as mlx_lm_utils  # the independent oracle; a test extra, never skipped
from mlx.utils import tree_flatten
from mlx_lm import convert
from mlx_lm import load as mlx_lm_load
from mlx_lm.generate import generate_step

from kvlayout.models.loading import save_model
from kvlayout.models.presets import build_preset, preset_config, write_preset

# What `kvlayout`'s GGUF import writes for a Q4_1 model with a Q8_0 embedding.
GGUF_QUANTIZATION = {"group_size": 32, "bits": 4, "model.embed_tokens": {"group_size": 32, "bits": 8}}


def convert_tiny(
    out: Path,
    bits: int,
    group_size: int,
    tied: bool = False,
    predicate: Callable[[str, nn.Module], bool | dict] | str | None = None,
    seed: int = 3,
    dtype: str | None = None,
    **overrides,
) -> Path:
    """`mlx_lm.convert -q` on the tiny preset (tied or not; `overrides` change its config, e.g.
    head_dim); `predicate` is convert's quant_predicate (a function, or a recipe such as "mixed_3_6");
    `dtype` is convert's (None: config.json's float32), the floats' and so the scales' and biases'."""
    src = write_preset(out.with_name(out.name + "-float"), "tiny", seed=seed, tie_word_embeddings=tied, **overrides)
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]")).save(str(src / "tokenizer.json"))
    convert(str(src), str(out), quantize=True, q_bits=bits, q_group_size=group_size, quant_predicate=predicate,
            dtype=dtype)
    return out


def mlx_lm_dequantized(model_dir: Path, out: Path, dtype: str = "float32") -> Path:
    """What `mlx_lm.convert --dequantize --dtype DTYPE` writes for the quantized `model_dir` (the oracle of
    kvlayout's dequantizing at load): its tensors, config.json without `quantization`, the tokenizer."""
    convert(str(model_dir), str(out), dequantize=True, dtype=dtype)
    return out


def embed_8bit(path: str, module: nn.Module) -> bool | dict:
    """convert's quant_predicate for the GGUF import's packing: the embedding 8-bit, the rest the default."""
    return {"group_size": 32, "bits": 8} if path == "model.embed_tokens" else True


def gguf_shaped(out: Path, seed: int = 3) -> Path:
    """The tiny preset packed as the GGUF import packs one, config.json's section exactly GGUF_QUANTIZATION.

    Packed by MLX's `nn.quantize`, written by kvlayout's own writer (no `mode`,
    no `quantization_config`: only what the importer writes).
    """
    model, _, _ = build_preset("tiny", seed=seed)
    nn.quantize(
        model, 32, 4, class_predicate=lambda p, m: hasattr(m, "to_quantized") and GGUF_QUANTIZATION.get(p, True)
    )
    save_model(out, preset_config("tiny", quantization=GGUF_QUANTIZATION), dict(tree_flatten(model.parameters())))
    return out


def edit_config(model_dir: Path, **changes) -> None:
    """Rewrite config.json with `changes` (a value of None removes the key)."""
    path = Path(model_dir) / "config.json"
    cfg = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    path.write_text(json.dumps(cfg))


def mlx_lm_greedy(
    model_dir: Path, prompt: Sequence[int], max_tokens: int, eos: Sequence[int] | None = None
) -> list[int]:
    """mlx-lm's greedy tokens (its default sampler is argmax), cut where kvlayout stops: at an EOS.

    `eos` None: the ids mlx-lm's own tokenizer for the directory ends on (mlx_lm.load).
    """
    if eos is None:
        model, tokenizer = mlx_lm_load(str(model_dir))
        eos = tokenizer.eos_token_ids
    else:
        model, _ = mlx_lm_utils.load_model(Path(model_dir))
    out = []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens):
        if int(token) in eos:
            break
        out.append(int(token))
    return out


def packings(model: nn.Module) -> dict[str, tuple[int, int] | None]:
    """Every Linear/Embedding path -> (bits, group_size) when quantized, None when in floats."""
    out = {}
    for path, m in model.named_modules():
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            out[path] = (m.bits, m.group_size)
        elif isinstance(m, (nn.Linear, nn.Embedding)):
            out[path] = None
    return out
