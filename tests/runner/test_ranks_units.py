"""Tensor-parallel pieces on their own, in one process: what ends a run, what rank 0 tells the others,
what a quantized model may be split into (the launched runs are tests/runner/test_tensor_parallel.py)."""

from __future__ import annotations

import numpy as np
import pytest

from kvlayout.distributed import DistributedError, RankedModel, World
from kvlayout.engines.recovery import guarded_forward
from kvlayout.errors import ConfigError, RunEnded
from kvlayout.models.loading import load_model
from kvlayout.models.shard import check_shardable
from kvlayout.server.replica import Leading
from tests.models.conftest import quantized_dir  # noqa: F401 - the session fixture


class Aborting:
    """A cache with the StepAbort face that counts its aborts."""

    def __init__(self):
        self.aborted = 0

    def abort_step(self) -> bool:
        self.aborted += 1
        return True


def test_a_lost_rank_ends_the_run_through_the_guarded_forward_unretried():
    assert issubclass(DistributedError, RunEnded)

    def lost(*args, **kwargs):
        raise RuntimeError("[ring] connection to a peer was lost")

    cache = Aborting()
    with pytest.raises(DistributedError, match=r"rank 0 of 1: lost its connection to another rank while computing a "
                                                r"forward \(its all_sums\) \(RuntimeError: \[ring\] connection"):
        guarded_forward(RankedModel(lost, World()), cache, [1], [0], [0])
    assert cache.aborted == 1  # the step was taken back before the run ended


def test_any_failure_of_a_ranks_forward_ends_the_run_naming_it():
    def broken(*args, **kwargs):
        raise ValueError("bad shape")

    with pytest.raises(DistributedError, match=r"rank 0 of 1: failed while computing a forward.*ValueError: bad shape"):
        guarded_forward(RankedModel(broken, World()), Aborting(), [1], [0], [0])


class Engine:
    def __init__(self):
        self.calls = []

    def add(self, requests):
        self.calls.append(("add", [r.index for r in requests]))

    def cancel(self, request):
        self.calls.append(("cancel", request.index))


class Sent(World):
    """A world of one that keeps what rank 0 would send."""

    def __init__(self):
        super().__init__()
        self.sent = []

    def json_from_leader(self, obj, what):
        self.sent.append(obj)
        return obj


def test_rank_0_tells_only_cancels_of_requests_its_engine_was_given():
    from kvlayout.engines.records import Request, Sample

    def request(i):
        return Request(i, [1, 2], 4, 1, [Sample(i, 0, np.random.default_rng(i))])

    world, engine = Sent(), Engine()
    lead = Leading(engine, world)
    lead.add([request(0)])
    lead.cancel(request(0))
    lead.cancel(request(1))  # a ticket still queued at shutdown: the engine never had it
    lead.finish()
    (notes,) = world.sent
    assert [n[0] for n in notes] == ["add", "cancel", "stop"] and notes[1] == ["cancel", 0]
    assert engine.calls == [("add", [0]), ("cancel", 0), ("cancel", 1)]  # the engine itself hears both


def test_a_quantized_projection_is_not_split_inside_a_group(quantized_dir):  # noqa: F811
    # The tiny preset's o_proj takes 4 heads x 16 = 64 inputs: groups of 64 leave 32 a rank at 2 ranks.
    model, args, _ = load_model(quantized_dir("4bit_g64_tied"))
    with pytest.raises(ConfigError, match=r"layer 0 self_attn.o_proj has 64 inputs quantized in groups of 64: "
                                          r"2 ranks would split a group \(32 inputs each\)"):
        check_shardable(args, 2, "tiny", model)
    model, args, _ = load_model(quantized_dir("4bit_g32_untied"))
    check_shardable(args, 2, "tiny", model)  # groups of 32: 32 inputs a rank, whole groups
