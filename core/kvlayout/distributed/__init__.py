"""Tensor-parallel runs over `mx.distributed`: the ranks (`World`) and what they exchange.

The model is split by `kvlayout.models.shard`; the runner decides what each
rank runs (`kvlayout.runner.job`). See docs/design.md, "Tensor parallel".
"""

from kvlayout.distributed.world import RankedModel, World, current, launched
from kvlayout.errors import DistributedError

__all__ = ["DistributedError", "RankedModel", "World", "current", "launched"]
