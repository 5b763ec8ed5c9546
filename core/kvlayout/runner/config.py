"""The runner's TOML config: frozen attrs records, validated at construction.

Every section is a record; an unknown key or a bad value raises ConfigError
naming the dotted key (`cache.capcity`) and what is allowed, before any model
is loaded. `load_config(None)` gives the embedded default, which is what
`kvlayout run` with no argument runs.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from kvlayout.builder import layout_key, split_layout_key
from kvlayout.checks import finite_number, int_scalar, reject_unknown
from kvlayout.config import KV_DTYPES, CacheConfig, LayerConfig, chosen_fields
from kvlayout.engines.options import SPECULATE
from kvlayout.errors import ConfigError, os_reason
from kvlayout.models.chat import ROLES

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser as a package (pyproject: tomli; python_version < '3.11')
    import tomli as tomllib

DEFAULT_TOML = """\
# The embedded default: SmolLM2-135M-Instruct (downloaded once, then cached) answering
# a few questions that share a system prompt, two samples each, batched through mlx:cell.
# About 6 s on two CPU cores with the OpenBLAS kvlayout preloads (30 layers, dequantized to float32;
# 6 sequences decode at ~35 tok/s together); ~22 s with --blas none (4-bit, the reference BLAS).
[layout]
backend = "mlx"
kind = "cell"

[cache]
capacity = 2048
kv_dtype = "auto"        # float32 on the CPU device, float16 on a GPU; "q8"/"q4": quantized K/V

[model]
preset = "smollm2"       # SmolLM2-135M-Instruct; see kvlayout.models.smollm2 for where it comes from
fallback = "tiny"        # when it cannot be had: say why, and run the tiny random preset instead

[sampling]
temperature = 0.7        # sampled, so the two samples of a question differ
top_p = 0.9
seed = 0

[engine]
prefill_chunk = 256      # prompt tokens a step carries: float32 matmuls through BLAS pay by the row
pipeline = true          # greedy samples draw their next token on the device, a step ahead
# speculate = "ngram"    # draft up to speculate_tokens (4) tokens a sample from its own text; greedy: same output

[[requests]]
messages = [
  { role = "system", content = "You are a helpful assistant. Answer in one short sentence." },
  { role = "user", content = "What is the capital of France?" },
]
max_tokens = 40
n = 2

[[requests]]
messages = [
  { role = "system", content = "You are a helpful assistant. Answer in one short sentence." },
  { role = "user", content = "Why is the sky blue?" },
]
max_tokens = 40
n = 2

[[requests]]
messages = [
  { role = "system", content = "You are a helpful assistant. Answer in one short sentence." },
  { role = "user", content = "Give me a tip for writing clear code." },
]
max_tokens = 40
n = 2
"""

MODEL_DTYPES = ("auto", "float32", "float16", "bfloat16")


def _fail(key: str, value: Any, expected: str) -> ConfigError:
    return ConfigError(f"{key}={value!r}: expected {expected}")


def _int(key: str, value: Any, minimum: int, maximum: int | None = None) -> None:
    int_scalar(key, value, ConfigError, minimum, maximum, numpy=False)  # TOML gives Python ints


@attrs.frozen
class LayoutSection:
    backend: str = "mlx"
    kind: str = "cell"

    def __attrs_post_init__(self):
        for name in ("backend", "kind"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise _fail(f"layout.{name}", value, "a non-empty string")

    @property
    def key(self) -> str:
        return layout_key(self.backend, self.kind)


@attrs.frozen(these=chosen_fields(capacity=4096, kv_dtype="auto"))
class CacheSection:
    """[cache]: CacheConfig's fields the model does not imply (its layers' shapes and windows come
    from the model), each checked by CacheConfig's own rule; kv_dtype may also be "auto" (the
    job picks the device's: `job.default_kv_dtype`)."""

    TABLE = "cache"  # a refusal names `cache.capacity`
    KV_DTYPE_CHOICES = ("auto", *KV_DTYPES)

    def cache_config(self, n_layers: int, layers: Sequence[LayerConfig], kv_dtype: str) -> CacheConfig:
        """The CacheConfig of this section for a model of `n_layers` layers shaped `layers`, its K/V
        stored as `kv_dtype` ("auto" resolved); pools start no larger than the capacity."""
        chosen = attrs.asdict(self)
        chosen.update(kv_dtype=kv_dtype, initial_capacity=min(self.initial_capacity, self.capacity))
        return CacheConfig(n_layers=n_layers, layers=layers, **chosen)


DEQUANTIZE_CAP_MB = 4096  # the most [model] dequantize_max_mb defaults to, whatever the memory


def default_dequantize_max_mb() -> int:
    """[model] dequantize_max_mb's default: a quarter of physical memory, at most 4096 (MB of 2**20 bytes)."""
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # no sysconf, or no such name: the cap alone
        return DEQUANTIZE_CAP_MB
    return min(DEQUANTIZE_CAP_MB, physical // 4 // 2**20)


@attrs.frozen
class ModelSection:
    """A local HF directory (`path`) or a built-in preset (`preset`), exactly one.

    `fallback` (with `preset` only): a preset to run instead when `preset`
    cannot be had (a download that fails); the run says why, in one line.

    `dequantize`: whether a quantized checkpoint is unpacked into float layers
    at load (`job.dequantize_as_configured`). "auto" does it on the CPU device
    when `dtype` is auto or float32 and the float32 weights fit in
    `dequantize_max_mb` MB (MLX's CPU backend multiplies packed weights far
    slower than float32 ones through BLAS); a model over that budget stays
    packed and the run says so. true: on any device, into `dtype` (auto:
    float32), whatever the size; false: never. Quantized K/V cells
    ([cache] kv_dtype) are another matter, untouched either way.
    """

    path: str | None = None
    preset: str | None = None
    fallback: str | None = None
    dtype: str = "auto"  # auto: as stored
    seed: int = 0  # a preset's weights
    dequantize: str | bool = "auto"
    # Default: a quarter of physical memory, at most 4096; 0: "auto" never dequantizes.
    dequantize_max_mb: int = attrs.field(factory=default_dequantize_max_mb)

    def __attrs_post_init__(self):
        if (self.path is None) == (self.preset is None):
            raise ConfigError(
                "model: expected exactly one of model.path (a Hugging Face model directory) "
                "or model.preset (\"smollm2\" or \"tiny\")"
            )
        if self.fallback is not None and self.preset is None:
            raise ConfigError("model.fallback: only a preset falls back; a model.path that fails is an error")
        for name in ("path", "preset", "fallback"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise _fail(f"model.{name}", value, "a non-empty string")
        if self.dtype not in MODEL_DTYPES:
            raise _fail("model.dtype", self.dtype, f"one of {', '.join(MODEL_DTYPES)}")
        _int("model.seed", self.seed, 0)
        if not (type(self.dequantize) is bool or self.dequantize == "auto"):  # 1 == True: the type decides
            raise _fail("model.dequantize", self.dequantize, '"auto", true or false')
        _int("model.dequantize_max_mb", self.dequantize_max_mb, 0)


@attrs.frozen
class SamplingSection:
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __attrs_post_init__(self):
        if finite_number("sampling.temperature", self.temperature, ConfigError) < 0:
            raise _fail("sampling.temperature", self.temperature, "a number >= 0 (0 = greedy)")
        top_p = finite_number("sampling.top_p", self.top_p, ConfigError)
        if not 0 < top_p <= 1:
            raise _fail("sampling.top_p", self.top_p, "a number in (0, 1]")
        _int("sampling.seed", self.seed, 0)


@attrs.frozen
class EngineSection:
    # Prompt tokens one step may carry across newly admitted requests (decode tokens come on top).
    # 256: on the CPU a float32 step's matmuls run through BLAS, cheaper by the row the more rows a
    # step has (SmolLM2, a 477-token prompt: 241 tok/s at 64, 301 at 256, 286 at 512).
    prefill_chunk: int = 256
    # Greedy tokens drawn on the device, the next forward queued before the host reads them
    # (engines.ahead); false: every step waits for its logits on the host. Same tokens either way.
    pipeline: bool = True
    # "ngram": each decoding sample drafts up to speculate_tokens tokens by matching the last n-gram of
    # its own prompt and output, and one step verifies them (engines.drafts); greedy output is the same
    # token for token, and a sample whose drafts are not kept backs off. "off": one token a step.
    speculate: str = "off"
    # The most draft tokens a sample proposes in one step: more pays on repetitive text, costs on the rest.
    speculate_tokens: int = 4

    MAX_SPECULATE_TOKENS = 16

    def __attrs_post_init__(self):
        _int("engine.prefill_chunk", self.prefill_chunk, 1)
        if type(self.pipeline) is not bool:
            raise _fail("engine.pipeline", self.pipeline, "true or false")
        if not isinstance(self.speculate, str) or self.speculate not in SPECULATE:
            raise _fail("engine.speculate", self.speculate, " or ".join(f'"{v}"' for v in SPECULATE))
        _int("engine.speculate_tokens", self.speculate_tokens, 1, self.MAX_SPECULATE_TOKENS)


@attrs.frozen
class Message:
    """One turn of a chat request: `role` is system, user or assistant."""

    role: str
    content: str


def _messages(value: Any, where: str) -> tuple[Message, ...]:
    """`messages = [{role = "...", content = "..."}, ...]` as Message records, or ConfigError naming the entry."""
    if not isinstance(value, (list, tuple)) or not value:
        raise _fail(f"{where}.messages", value, "a non-empty list of {role, content} tables")
    out = []
    for j, m in enumerate(value):
        at = f"{where}.messages[{j}]"
        if isinstance(m, Message):
            m = attrs.asdict(m)
        reject_unknown(m, ["role", "content"], "chat message", prefix=at, required=["role", "content"])
        if m["role"] not in ROLES:
            raise _fail(f"{at}.role", m["role"], f"one of {', '.join(ROLES)}")
        if not isinstance(m["content"], str):
            raise _fail(f"{at}.content", m["content"], "a string")
        out.append(Message(m["role"], m["content"]))
    return tuple(out)


@attrs.frozen
class RequestSpec:
    """One request: a prompt (text, ids, or chat `messages`) and `n` samples of up to `max_tokens` tokens.

    `messages` are rendered with the model's chat template. A sample also
    stops, with finish_reason "stop", once its text holds one of the `stop`
    strings; its text is cut before it.
    """

    prompt: str | None = None
    prompt_ids: tuple[int, ...] | None = attrs.field(
        default=None, converter=lambda v: tuple(v) if isinstance(v, list) else v
    )
    messages: tuple[Message, ...] | None = None
    stop: tuple[str, ...] = attrs.field(default=(), converter=lambda v: tuple(v) if isinstance(v, list) else v)
    max_tokens: int = 32
    n: int = 1
    where: str = attrs.field(default="requests[?]", eq=False, repr=False)

    def __attrs_post_init__(self):
        w = self.where
        given = [k for k in ("prompt", "prompt_ids", "messages") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ConfigError(
                f"{w}: expected exactly one of prompt (text), prompt_ids (a list of ints) "
                f"or messages (a list of {{role, content}} tables), got {' and '.join(given) or 'none'}"
            )
        if self.prompt is not None and (not isinstance(self.prompt, str) or not self.prompt):
            raise _fail(f"{w}.prompt", self.prompt, "a non-empty string")
        if self.prompt_ids is not None:
            if not isinstance(self.prompt_ids, tuple) or not self.prompt_ids:
                raise _fail(f"{w}.prompt_ids", self.prompt_ids, "a non-empty list of token ids")
            for i in self.prompt_ids:
                _int(f"{w}.prompt_ids[]", i, 0)
        if self.messages is not None:
            object.__setattr__(self, "messages", _messages(self.messages, w))  # frozen: set once, here
        if not isinstance(self.stop, tuple) or not all(isinstance(x, str) and x for x in self.stop):
            raise _fail(f"{w}.stop", self.stop, "a list of non-empty strings")
        _int(f"{w}.max_tokens", self.max_tokens, 1)
        _int(f"{w}.n", self.n, 1)


# The sections `kvlayout run` and `kvlayout serve` share, by their TOML names.
SECTIONS = {
    "layout": LayoutSection,
    "cache": CacheSection,
    "model": ModelSection,
    "sampling": SamplingSection,
    "engine": EngineSection,
}


class LayoutAndModel:
    """What `kvlayout run`'s and `kvlayout serve`'s configs both answer: the flags that replace
    their layout or model, and where the model directory is. Needs `layout`, `model`, `base_dir`."""

    def with_layout(self, key: str):
        """`--layout backend:kind` overrides the config's layout."""
        return attrs.evolve(self, layout=LayoutSection(*split_layout_key(key, "--layout")))

    def with_model_path(self, path: str):
        """`--model DIR` replaces the config's [model] (no fallback: a directory given is meant)."""
        return attrs.evolve(self, model=ModelSection(path=str(Path(path).expanduser().resolve())))

    def with_engine(self, **changes: Any):
        """Flags that replace [engine] keys (`--speculate`): the section rebuilt, so each value is
        checked by its own rule and a bad one is refused naming its key (`engine.speculate_tokens`)."""
        return attrs.evolve(self, engine=attrs.evolve(self.engine, **changes))

    def model_dir(self) -> Path | None:
        """The model directory; a relative path is taken from the config file's directory."""
        if self.model.path is None:
            return None
        return (self.base_dir / Path(self.model.path).expanduser()).resolve()


@attrs.frozen
class RunConfig(LayoutAndModel):
    layout: LayoutSection = LayoutSection()
    cache: CacheSection = CacheSection()
    model: ModelSection = ModelSection(preset="tiny")
    sampling: SamplingSection = SamplingSection()
    engine: EngineSection = EngineSection()
    requests: tuple[RequestSpec, ...] = ()
    source: str = attrs.field(default="<default>", eq=False)
    base_dir: Path = attrs.field(factory=Path.cwd, eq=False, repr=False)
    # Not a TOML key: set only where the run says so (`--prompt`, a model.fallback taken):
    # chat messages on a model without a chat template are sent as plain text, not refused.
    plain_chat: bool = attrs.field(default=False, eq=False)

    def __attrs_post_init__(self):
        if not self.requests:
            raise ConfigError(f"{self.source}: no [[requests]]; add at least one with a prompt")

    @classmethod
    def from_mapping(
        cls, data: Mapping[str, Any], source: str = "<mapping>", base_dir: Path | None = None
    ) -> RunConfig:
        sections = SECTIONS
        reject_unknown(data, [*sections, "requests"], f"{source}: config")  # the top-level table
        kwargs: dict[str, Any] = {}
        for name, section in sections.items():
            if name in data:
                kwargs[name] = read_section(section, data[name], name, source)
        requests = data.get("requests", [])
        if not isinstance(requests, list):
            raise ConfigError(f"{source}: requests: expected an array of tables ([[requests]])")
        kwargs["requests"] = tuple(
            read_section(RequestSpec, r, f"requests[{i}]", source, where=f"requests[{i}]")
            for i, r in enumerate(requests)
        )
        return cls(**kwargs, source=source, base_dir=base_dir or Path.cwd())



def read_section(cls: type, data: Any, prefix: str, source: str, **extra: Any):
    """The table `data` as the record `cls` (one of the sections, or a section of another
    command's config, e.g. `kvlayout serve`'s [server]); ConfigError naming `source` and the key."""
    valid = [f.name for f in attrs.fields(cls) if f.name != "where"]
    reject_unknown(data, valid, source, prefix)
    try:
        return cls(**data, **extra)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None


PROMPT_ROOM = 8192  # cells for a --prompt's own tokens; --max-tokens comes on top


def prompt_config(
    prompt: str, model_path: str | None = None, max_tokens: int = 128, temperature: float = 0.0, raw: bool = False
) -> RunConfig:
    """`kvlayout run --prompt TEXT`: one request, on `model_path` or else the default's model.

    The prompt goes as one user message, rendered with the model's chat
    template; as plain text with `raw`, or when the model has none (the run says so).
    """
    default = tomllib.loads(DEFAULT_TOML)
    request: dict[str, Any] = {"max_tokens": max_tokens, "n": 1}
    if raw:
        request["prompt"] = prompt
    else:
        request["messages"] = [{"role": "user", "content": prompt}]
    data = {
        "layout": default["layout"],
        # A ceiling the prompt and max_tokens fit under (pools grow as needed, so it costs little).
        "cache": {**default["cache"], "capacity": PROMPT_ROOM + max_tokens},
        "model": {"path": model_path} if model_path is not None else default["model"],
        "sampling": {"temperature": temperature},
        "requests": [request],
    }
    cfg = RunConfig.from_mapping(data, source="--prompt")
    return attrs.evolve(cfg, plain_chat=True)


def dump_config(cfg: RunConfig) -> str:
    """`cfg` as TOML that `load_config` reads back to an equal config (`kvlayout run --print-config`).

    Every key is written, defaults included, so the text shows all the run uses.
    A model.path is written absolute (taken from the config's directory), so the
    text means the same wherever it is saved.
    """
    lines: list[str] = []
    for name in ("layout", "cache", "model", "sampling", "engine"):
        section = getattr(cfg, name)
        lines.append(f"[{name}]")
        for field in attrs.fields(type(section)):
            value = getattr(section, field.name)
            if (name, field.name) == ("model", "path") and value is not None:
                value = str(cfg.model_dir())
            if value is not None:
                lines.append(f"{field.name} = {_toml_value(value)}")
        lines.append("")
    for request in cfg.requests:
        lines.append("[[requests]]")
        for field in attrs.fields(RequestSpec):
            value = getattr(request, field.name)
            if field.name == "where" or value is None:
                continue
            if field.name == "messages":  # one inline table a line
                lines.append("messages = [")
                lines += [f"  {{ role = {_toml_str(m.role)}, content = {_toml_str(m.content)} }}," for m in value]
                lines.append("]")
            else:
                lines.append(f"{field.name} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


# What a TOML basic string must escape; other control characters are written \uXXXX.
_TOML_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def _toml_str(text: str) -> str:
    escaped = (
        _TOML_ESCAPES.get(c) or (f"\\u{ord(c):04x}" if c < " " or c == "\x7f" else c) for c in text
    )
    return '"' + "".join(escaped) + '"'


def _toml_value(value: Any) -> str:
    """A config value as TOML: a string, an integer, a (finite) float, or a list of them."""
    if isinstance(value, str):
        return _toml_str(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)  # a float's repr is a TOML float (the config refuses nan and inf)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML form for {value!r}")


def load_config(path: str | Path | None = None) -> RunConfig:
    """The config at `path`, or the embedded default when None.

    `path` may be any file that reads as UTF-8 TOML, a pipe included
    (`kvlayout run <(...)`); a relative model.path is taken from the directory
    of a regular file, from the working directory otherwise. ConfigError, naming
    the file, when it cannot be read: missing, a directory, not UTF-8, not TOML.
    """
    if path is None:
        return RunConfig.from_mapping(tomllib.loads(DEFAULT_TOML), source="<embedded default>")
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise ConfigError(f"path={path!r}: expected a TOML file path (str or Path), or None for the default")
    path = Path(path)
    data = read_toml(path)
    base_dir = path.resolve().parent if path.is_file() else Path.cwd()
    return RunConfig.from_mapping(data, source=str(path), base_dir=base_dir)


def parse_config(text: str, source: str) -> RunConfig:
    """The config in TOML `text` (what `dump_config` wrote: its model.path is absolute)."""
    return RunConfig.from_mapping(tomllib.loads(text), source=source)


def read_toml(path: Path) -> dict[str, Any]:
    """The table in the TOML file `path`; ConfigError naming the file for each way it can fail to be one."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(
            f"config file {str(path)!r} does not exist; pass a TOML file or no argument for the default"
        ) from None
    except IsADirectoryError:
        raise ConfigError(
            f"config file {str(path)!r} is a directory; pass a TOML file or no argument for the default"
        ) from None
    except OSError as exc:  # unreadable, a path through a file, ...
        raise ConfigError(f"config file {str(path)!r} cannot be read ({os_reason(exc)})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{path}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start}); a TOML file is UTF-8"
        ) from None
    try:
        return tomllib.loads(text.removeprefix("\ufeff"))  # the byte-order mark some editors write
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML ({exc})") from None
