"""What a layout hands `attend()`: the keys and values of one layer's step and how to mask them.

These records are the contract between a layout's `update_and_fetch` (the
KVCache face) and `kvlayout.mlx.attend`, which consumes them. They hold
arrays of any kind (`Any`): MLX arrays when a layout hands them to
`attend()`, numpy arrays while a layout plans them (the cell layout's
grouping is planned in numpy, then converted field by field). Nothing here
imports MLX, so a layout's neutral bookkeeping may use `MaskKind`.
"""

from __future__ import annotations

import enum
from typing import Any

import attrs


class MaskKind(enum.Enum):
    """What `attend()` must apply: nothing, lower-right causal, or `AttendSpec.mask`."""

    NONE = "none"
    CAUSAL = "causal"
    EXPLICIT = "explicit"


@attrs.frozen(eq=False)
class QuantizedKV:
    """K or V stored affine-quantized (MLX's `mx.quantize`): the triple `mx.quantized_matmul` reads.

    Element j of a row is `scales[g] * w_j + biases[g]` for its group g of
    `group_size` elements, `w_j` the `bits`-bit integer packed little end
    first into the uint32 words of `packed` (`32 // bits` to a word).

    - `packed` uint32 `[..., D * bits / 32]`;
    - `scales`, `biases` `[..., D / group_size]`, one per group, in the
      float dtype quantization started from (float16 in kvlayout's pools).

    Its `shape` is the logical one, `[..., D]`, so a spec's `keys.shape`
    reads `[1, H_kv, S, D]` whether or not they are quantized.
    """

    packed: Any
    scales: Any
    biases: Any
    bits: int
    group_size: int

    @property
    def shape(self) -> tuple[int, ...]:
        *lead, words = self.packed.shape
        return (*lead, words * 32 // self.bits)

    def parts(self) -> tuple[Any, Any, Any]:
        """(packed, scales, biases), in the order `mx.quantized_matmul` takes them."""
        return self.packed, self.scales, self.biases

    def map(self, fn) -> QuantizedKV:
        """The same quantization with `fn` applied to each part (a slice, a gather on a token axis)."""
        return attrs.evolve(self, packed=fn(self.packed), scales=fn(self.scales), biases=fn(self.biases))


@attrs.frozen(eq=False)
class AttendGroups:
    """A sparse step's tokens in G groups, each with the only cells it may attend.

    Prepared once per window per step (the index arrays are shared by every
    layer with that window); `keys`/`values` are the layer's own.

    - `tokens` int32 `[G, Qg]`: the step's token indices of each group; a
      group with fewer tokens repeats its last one (its output is dropped).
    - `cells` int32 `[G, Kg]`: the cells (indices on the cell axis of `keys`)
      each group may attend; a shorter group pads with any valid cell, masked.
    - `mask` bool `[G, 1, Qg, Kg]` (True = attend), or None when every slot
      is visible (no key padding and no query sees less than its group).
    - `out` int32 `[T]`: where token t's output sits among the `G * Qg`
      grouped query slots (group-major).
    - `keys`/`values` `[1, H_kv, S, D]`, S > every cell: what the cells index.
      Row-contiguous arrays (a layout passes its whole pool buffer) let the
      gather read them as `[H_kv * S, D]` rows with no copy. QuantizedKV
      triples are gathered part by part (a paged batch too: its pages'
      cells are gathered, a quarter to an eighth of float32's bytes).
    - `page` (optional, 0 = off): B > 0 makes `cells` int32 `[G, P]` page
      indices instead, page p being cells `[p * B, (p + 1) * B)`, read in
      place (S must be a multiple of B: the pages are a view of the pool,
      where gathering would copy the rows); `tail` (optional) int32
      `[G, Kt]` are cells gathered beside them. The group attends the
      `P * B` slots of its pages, in page order, then its tail, under `mask`
      `[G, 1, Qg, P * B + Kt]`.
    - `more` (optional): further batches of groups, each an `AttendBatch`
      shaped like the fields above, each run apart so it is padded only to
      its own longest group; `out` then indexes the grouped query slots of
      all batches, concatenated in order (the fields first).
    - `in_order` (optional, False unless a layout knows): True when those
      grouped query slots, concatenated, are the step's tokens 0..T-1 in
      order (every group full, groups in token order: a decode step of one
      token per sequence, usually). `out` is then the identity, and a
      consumer may take each batch's queries as a run of q's token axis
      (a view) instead of gathering them by `tokens`.
    """

    tokens: Any
    cells: Any
    mask: Any
    out: Any
    keys: Any = None
    values: Any = None
    more: tuple[AttendBatch, ...] = ()
    page: int = 0
    tail: Any = None
    in_order: bool = False

    def over(self, keys: Any, values: Any) -> AttendGroups:
        """The same groups over `keys` and `values` (a layer's own; the plan is every layer's of its
        window). What `attrs.evolve` would make, for a fraction of its host time: a layer's step asks."""
        return AttendGroups(self.tokens, self.cells, self.mask, self.out, keys, values, self.more, self.page,
                            self.tail, self.in_order)

    def batches(self) -> tuple[AttendBatch, ...]:
        """Every batch, the fields' first, as AttendBatch records."""
        head = AttendBatch(self.tokens, self.cells, self.mask, self.page, self.tail)
        return (head, *self.more)


@attrs.frozen(eq=False)
class AttendBatch:
    """One batch of groups of an AttendGroups: its fields of the same names, for one batch."""

    tokens: Any
    cells: Any
    mask: Any
    page: int = 0
    tail: Any = None


@attrs.frozen(eq=False)
class AttendSpec:
    """Keys and values a layer attends to, and how to mask them.

    `keys`/`values` are `[1, H_kv, S, D]`, as float arrays or as QuantizedKV
    triples of that logical shape (a cache whose kv_dtype is "q8" or "q4";
    `attend()` then multiplies through `mx.quantized_matmul`, never
    dequantizing the pool); `mask` is a bool `[1, 1, T, S]` array for
    EXPLICIT only, None otherwise.

    `groups` (optional, additive): when a layout sets it, `attend()` computes
    the same result as the dense EXPLICIT mask by attending each group of
    tokens to its own cells only (one batched SDPA over the groups); the
    dense fields stay valid, so any consumer may ignore `groups`.

    `mask` may be given as a function of no argument that computes it: a
    layout whose `groups` carry the work builds the dense mask only for a
    consumer that reads it (on first access, then kept). So may `keys` and
    `values` when `groups` is set (`attend()` reads the groups' own): their
    dense reads are made only for a consumer that asks.

    `queries` (optional): T, the tokens of the step, so the queries attending
    must number T; `attend()` refuses a q of another length (MLX would
    broadcast a one-row mask, or none, over it and answer silently). Both
    shipped layouts set it.
    """

    _keys: Any = attrs.field(alias="keys", repr=False)
    _values: Any = attrs.field(alias="values", repr=False)
    mask_kind: MaskKind
    _mask: Any = attrs.field(default=None, alias="mask", repr=False)
    groups: AttendGroups | None = None
    queries: int | None = None

    @property
    def keys(self) -> Any:
        return self._made("_keys")

    @property
    def values(self) -> Any:
        return self._made("_values")

    @property
    def mask(self) -> Any:
        return self._made("_mask")

    def _made(self, field: str) -> Any:
        """The field, computed on first access when it was given as a function (then kept)."""
        value = getattr(self, field)
        if callable(value):
            value = value()
            object.__setattr__(self, field, value)  # computed once; the record stays frozen otherwise
        return value
