"""The MLX byte layer every MLX layout shares."""

from kvlayout.mlx.attention import attend
from kvlayout.mlx.checks import check_kv
from kvlayout.mlx.pool import (
    DTYPES,
    MAX_SLOTS,
    Cells,
    MLXPool,
    cell_bytes,
    check_layer_dims,
    config_pool_bytes,
    pool_bytes,
    slot_bytes,
    storage_dtype,
)
from kvlayout.mlx.quantized import QuantizedPool, kv_pool

__all__ = [
    "Cells",
    "DTYPES",
    "MAX_SLOTS",
    "MLXPool",
    "QuantizedPool",
    "attend",
    "cell_bytes",
    "check_kv",
    "check_layer_dims",
    "config_pool_bytes",
    "kv_pool",
    "pool_bytes",
    "slot_bytes",
    "storage_dtype",
]
