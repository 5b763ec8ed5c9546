"""Cache configuration: frozen attrs records validated at construction.

Every invalid value raises ConfigError naming the field, the value and what is
allowed, so a TOML typo is caught before any pool is allocated.

A valid config may still ask for more than the machine has (capacity = 10**12
cells); each layout knows what it allocates up front and refuses that at build
through `check_up_front`, stating the bytes, before allocating anything.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, ClassVar

import attrs

from kvlayout.checks import int_scalar, reject_unknown
from kvlayout.errors import ConfigError

FLOAT_KV_DTYPES = ("float16", "bfloat16", "float32")
# Affine-quantized K/V (MLX's `mx.quantize`): name -> bits. Every kv_dtype is a name of either.
QUANTIZED_KV_BITS = {"q8": 8, "q4": 4}
KV_DTYPES = (*FLOAT_KV_DTYPES, *QUANTIZED_KV_BITS)
KV_GROUP_SIZES = (32, 64, 128)  # what mx.quantized_matmul implements for affine quantization
DEFAULT_KV_GROUP_SIZE = 64  # mlx-lm's QuantizedKVCache default
POLICY_KINDS = ("flat", "ring")


def field_name(instance: Any, attribute: attrs.Attribute) -> str:
    """How a refusal names a field: `CacheConfig.capacity`; a record that holds fields of
    CacheConfig for a config file (`chosen_fields`) names them as its user writes them, with its
    `TABLE` (`cache.capacity`)."""
    return f"{getattr(instance, 'TABLE', type(instance).__name__)}.{attribute.name}"


def _int_at_least(minimum: int):
    """An attrs validator: an integer (a Python int: configs are serialized) >= `minimum`."""

    def check(instance, attribute, value):
        int_scalar(field_name(instance, attribute), value, ConfigError, minimum, numpy=False)

    return check


def _optional_positive(instance, attribute, value):
    if value is not None:
        _int_at_least(1)(instance, attribute, value)


def _known_keys(cls: type, data: Any) -> Mapping[str, Any]:
    """`data` checked to hold only `cls`'s fields, and every field without a default."""
    fields = attrs.fields(cls)
    required = [f.name for f in fields if f.default is attrs.NOTHING]
    # A key left out of a TOML table is a config mistake too, not a TypeError.
    return reject_unknown(data, [f.name for f in fields], cls.__name__, required=required)


@attrs.frozen
class LayerPolicy:
    """How a layer keeps history: all of it ("flat") or a sliding window ("ring")."""

    kind: str = "flat"
    window: int = 0

    def __attrs_post_init__(self):
        if self.kind not in POLICY_KINDS:
            raise ConfigError(
                f"LayerPolicy.kind={self.kind!r}: expected one of {', '.join(POLICY_KINDS)}"
            )
        int_scalar("LayerPolicy.window", self.window, ConfigError, numpy=False)
        if self.kind == "ring" and self.window <= 0:
            raise ConfigError(f"LayerPolicy.window={self.window!r}: a ring layer needs window > 0")
        if self.kind == "flat" and self.window != 0:
            raise ConfigError(
                f"LayerPolicy.window={self.window!r}: a flat layer keeps all history, window must be 0"
            )

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> LayerPolicy:
        _known_keys(cls, data)
        return cls(**data)

    def to_mapping(self) -> dict[str, Any]:
        return {"kind": self.kind, "window": self.window}


def _to_policy(value: Any) -> LayerPolicy:
    return LayerPolicy.from_mapping(value) if isinstance(value, Mapping) else value


@attrs.frozen
class LayerConfig:
    """The K/V shape of one layer and how it keeps history."""

    n_kv_heads: int = attrs.field(validator=_int_at_least(1))
    head_dim: int = attrs.field(validator=_int_at_least(1))
    policy: LayerPolicy = attrs.field(factory=LayerPolicy, converter=_to_policy)

    @policy.validator
    def _check_policy(self, attribute, value):
        if not isinstance(value, LayerPolicy):
            raise ConfigError(f"LayerConfig.policy={value!r}: expected a LayerPolicy or a mapping")

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> LayerConfig:
        _known_keys(cls, data)
        return cls(**data)

    def to_mapping(self) -> dict[str, Any]:
        return {
            "n_kv_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "policy": self.policy.to_mapping(),
        }


def _to_layers(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return tuple(LayerConfig.from_mapping(v) if isinstance(v, Mapping) else v for v in value)
    if isinstance(value, (LayerConfig, Mapping)):
        return _to_layers([value])
    return value


@attrs.frozen
class CacheConfig:
    """Sizes of a cache; `layers` holds one entry for every layer or one for all.

    `capacity` is the hard cap in cells; pools start at
    `min(initial_capacity, their max)` and grow by doubling.

    `kv_dtype` "q8" or "q4" stores K and V affine-quantized, `kv_group_size`
    elements (32, 64 or 128) sharing a float16 scale and bias; every layer's
    head_dim must divide by the group size. A float kv_dtype takes no group
    size (the default only), so a group size set by mistake is not ignored.

    Every field but the shape a model gives (SHAPE_FIELDS) is the user's
    choice; a config file's cache section holds exactly those (`chosen_fields`),
    checked by the same validators.
    """

    KV_DTYPE_CHOICES: ClassVar[tuple[str, ...]] = KV_DTYPES

    capacity: int = attrs.field(validator=_int_at_least(1))
    n_layers: int = attrs.field(validator=_int_at_least(1))
    layers: tuple[LayerConfig, ...] = attrs.field(converter=_to_layers)
    kv_dtype: str = attrs.field(default="float16")
    initial_capacity: int = attrs.field(default=512, validator=_int_at_least(0))
    max_write: int | None = attrs.field(default=None, validator=_optional_positive)
    max_seqs: int = attrs.field(default=64, validator=_int_at_least(1))
    kv_group_size: int = attrs.field(default=DEFAULT_KV_GROUP_SIZE)

    @layers.validator
    def _check_layers(self, attribute, value):
        if not isinstance(value, tuple) or not all(isinstance(x, LayerConfig) for x in value):
            raise ConfigError(f"CacheConfig.layers={value!r}: expected a list of LayerConfig")
        if len(value) not in (1, self.n_layers):
            raise ConfigError(
                f"CacheConfig.layers has {len(value)} entries: expected 1 (applies to every "
                f"layer) or n_layers={self.n_layers}"
            )

    @kv_dtype.validator
    def _check_dtype(self, attribute, value):
        if value not in self.KV_DTYPE_CHOICES:
            raise ConfigError(
                f"{field_name(self, attribute)}={value!r}: expected one of {', '.join(self.KV_DTYPE_CHOICES)}"
            )

    @kv_group_size.validator
    def _check_group_size(self, attribute, value):
        name = field_name(self, attribute)
        int_scalar(name, value, ConfigError, numpy=False)
        if value not in KV_GROUP_SIZES:
            raise ConfigError(f"{name}={value!r}: expected one of {', '.join(map(str, KV_GROUP_SIZES))}")
        if self.kv_dtype not in QUANTIZED_KV_BITS and value != DEFAULT_KV_GROUP_SIZE:
            raise ConfigError(
                f"{name}={value!r} with kv_dtype={self.kv_dtype!r}: a group size applies "
                f"to quantized K/V only (kv_dtype {' or '.join(QUANTIZED_KV_BITS)})"
            )

    def __attrs_post_init__(self):
        # Quantized K/V: every layer's head_dim divides into groups (after each field's own check).
        if self.kv_dtype not in QUANTIZED_KV_BITS:
            return
        group = self.kv_group_size
        for i, lc in enumerate(self.layers):
            if lc.head_dim % group:
                which = "every layer" if len(self.layers) == 1 else f"layer {i}"
                fits = [str(g) for g in KV_GROUP_SIZES if lc.head_dim % g == 0]
                fix = (
                    f"a kv_group_size of {' or '.join(fits)}" if fits else "a float kv_dtype (no group size divides it)"
                )
                raise ConfigError(
                    f"CacheConfig.kv_dtype={self.kv_dtype!r} with kv_group_size={group}: {which}'s "
                    f"head_dim={lc.head_dim} does not divide into groups of {group}; expected {fix}"
                )

    @property
    def kv_bits(self) -> int | None:
        """Bits per K/V element when quantized ("q8": 8, "q4": 4); None for a float kv_dtype."""
        return QUANTIZED_KV_BITS.get(self.kv_dtype)

    def layer(self, i: int) -> LayerConfig:
        i = int_scalar("layer index", i, ConfigError, 0, self.n_layers - 1, numpy=False)
        return self.layers[0] if len(self.layers) == 1 else self.layers[i]

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> CacheConfig:
        _known_keys(cls, data)
        return cls(**data)

    @classmethod
    def coerce(cls, config: Any) -> CacheConfig:
        """`config` if it is a CacheConfig, built from it if a mapping; ConfigError otherwise."""
        if isinstance(config, CacheConfig):
            return config
        if isinstance(config, Mapping):
            return cls.from_mapping(config)
        raise ConfigError(f"config: expected a CacheConfig or a mapping, got {type(config).__name__}")

    def to_mapping(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "capacity": self.capacity,
            "n_layers": self.n_layers,
            "layers": [layer.to_mapping() for layer in self.layers],
            "kv_dtype": self.kv_dtype,
            "initial_capacity": self.initial_capacity,
            "max_seqs": self.max_seqs,
        }
        if self.kv_group_size != DEFAULT_KV_GROUP_SIZE:  # files written before it existed read the same
            out["kv_group_size"] = self.kv_group_size
        if self.max_write is not None:  # TOML has no null
            out["max_write"] = self.max_write
        return out


SHAPE_FIELDS = ("n_layers", "layers")  # what a model's shape gives; every other field of CacheConfig is chosen


def chosen_fields(**defaults: Any) -> dict[str, Any]:
    """CacheConfig's chosen fields (all but SHAPE_FIELDS), in its order, with its validators and
    converters and `defaults` in place of its own: the fields of a config file's cache section
    (`attrs.frozen(these=chosen_fields(...))`), so each field and each rule is written once, here.

    The section's class sets `TABLE` (how its refusals name a field: `cache.capacity`) and may
    widen KV_DTYPE_CHOICES (a kv_dtype it resolves itself, such as "auto")."""
    fields = attrs.fields(CacheConfig)
    unknown = sorted(set(defaults) - {f.name for f in fields if f.name not in SHAPE_FIELDS})
    if unknown:
        raise ConfigError(f"chosen_fields: {', '.join(unknown)}: expected chosen fields of CacheConfig")
    return {
        f.name: attrs.field(
            default=defaults.get(f.name, f.default), validator=f.validator, converter=f.converter, type=f.type
        )
        for f in fields
        if f.name not in SHAPE_FIELDS
    }


# -- what a cache allocates, against what the machine has --------------------------------


def machine_memory() -> int | None:
    """Bytes of physical memory on this machine (`os.sysconf`); None where the OS cannot say."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows) or no such name
        return None
    return total if total > 0 else None


def show_bytes(n: int) -> str:
    """`n` bytes for a person: "7.28 TiB", "455 PiB", "512 B"."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            break
        n /= 1024
    if unit == "B":
        return f"{int(n)} B"
    return f"{n:.3g} {unit}" if n < 1e6 else f"{n:.3e} {unit}"


def check_up_front(what: str, parts: Mapping[str, int], fix: str) -> None:
    """ConfigError when the bytes a cache allocates up front (`parts`, by what holds them) exceed
    this machine's physical memory: such a request can never be met, and numpy or MLX would
    refuse it only part way (MemoryError, OverflowError). `what` names the request's fields and
    values, `fix` what to lower. Nothing is checked where the machine's memory is unknown."""
    total = sum(parts.values())
    have = machine_memory()
    if have is None or total <= have:
        return
    detail = "; ".join(f"{name}: {show_bytes(n)}" for name, n in parts.items())
    raise ConfigError(
        f"{what}: allocates {show_bytes(total)} ({total} bytes) up front ({detail}), more than this "
        f"machine's {show_bytes(have)} of memory; {fix}"
    )
