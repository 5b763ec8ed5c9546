"""The MLX byte layer every MLX layout shares."""

from kvlayout.mlx.attention import attend
from kvlayout.mlx.pool import DTYPES, MLXPool, storage_dtype

__all__ = ["DTYPES", "MLXPool", "attend", "storage_dtype"]
