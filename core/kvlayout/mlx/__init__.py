"""The MLX byte layer every MLX layout shares."""

from kvlayout.mlx.attention import attend
from kvlayout.mlx.pool import DTYPES, MAX_SLOTS, MLXPool, check_layer_dims, pool_bytes, storage_dtype

__all__ = ["DTYPES", "MAX_SLOTS", "MLXPool", "attend", "check_layer_dims", "pool_bytes", "storage_dtype"]
