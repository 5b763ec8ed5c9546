"""kvlayout: KV-cache layouts for LLM inference on MLX, delivered as plugins."""

from kvlayout.builder import Builder
from kvlayout.config import CacheConfig, LayerConfig, LayerPolicy
from kvlayout.errors import (
    CapacityError,
    ConfigError,
    DuplicateLayout,
    KVLayoutError,
    LayoutNotFound,
    PluginError,
    PluginStepError,
    RunEnded,
    SequenceError,
    ShapeError,
    StateError,
    StepError,
)
from kvlayout.faces import CellStep
from kvlayout.hookspecs import hookimpl
from kvlayout.persist import load
from kvlayout.registry import available, build, plugin_manager, resolve
from kvlayout.spec import AttendBatch, AttendGroups, AttendSpec, MaskKind

__all__ = [
    "AttendBatch",
    "AttendGroups",
    "AttendSpec",
    "Builder",
    "CacheConfig",
    "CapacityError",
    "CellStep",
    "ConfigError",
    "DuplicateLayout",
    "KVLayoutError",
    "LayerConfig",
    "LayerPolicy",
    "LayoutNotFound",
    "MaskKind",
    "PluginError",
    "PluginStepError",
    "RunEnded",
    "SequenceError",
    "ShapeError",
    "StateError",
    "StepError",
    "available",
    "build",
    "hookimpl",
    "load",
    "plugin_manager",
    "resolve",
]
__version__ = "0.1.0"  # the one place it is written: pyproject.toml reads it (dynamic version)
