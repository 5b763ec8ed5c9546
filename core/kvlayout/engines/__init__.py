"""The engines: what generates tokens through a cache, one step at a time.

An engine receives a model object and a cache (through the face it drives)
and knows neither the runner nor where the model came from: `engines.seq`
drives a SequenceControl cache one sample at a time, `engines.cell` batches
many sequences through a BatchControl cache. Both implement one interface
(`engines.interface.Engine`: add, step, run, state, restore) and fill the
records of `engines.records`. Nothing here imports `kvlayout.runner`.
"""

from kvlayout.engines.cell import CellEngine
from kvlayout.engines.interface import Engine
from kvlayout.engines.options import EngineOptions
from kvlayout.engines.records import OnProgress, OnToken, Request, Sample, Sampling, Stats, Stopper, make_requests
from kvlayout.engines.seq import SeqEngine
from kvlayout.errors import ForwardFailed, Interrupted

__all__ = [
    "CellEngine",
    "Engine",
    "EngineOptions",
    "ForwardFailed",
    "Interrupted",
    "OnProgress",
    "OnToken",
    "Request",
    "Sample",
    "Sampling",
    "SeqEngine",
    "Stats",
    "Stopper",
    "make_requests",
]
