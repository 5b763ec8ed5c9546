"""The runner asks a seq-like layout how many tokens one step may carry (`max_step` of its control face).

A third-party layout with its own rule is driven within it, and the shipped
seq layout gets the steps its own rule allows, no smaller and no larger.
"""

from __future__ import annotations

import pytest

import kvlayout
from kvlayout import Builder, hookimpl
from kvlayout.errors import StepError
from kvlayout.faces import FacesBase, SequenceControl, face_of
from kvlayout.runner import job
from tests.runner.conftest import QUESTIONS, SYSTEM, make_config, oracle_outputs, token_ids


class ThreeTokenSteps(FacesBase):
    """A third-party seq-like layout: the shipped seq cache underneath, but steps of at most 3 tokens.

    It refuses a longer step (as a layout with such a rule would) and records
    every step it was handed, so a test sees what the runner asked of it.
    """

    MAX_STEP = 3

    def __init__(self, config):
        self.inner = kvlayout.build("mlx", "seq", config)
        self.steps: list[int] = []  # tokens of every step handed to layer 0, refused or not

    def as_control(self):
        return face_of(SequenceControl, self)

    @property
    def max_step(self) -> int:
        return self.MAX_STEP

    @property
    def capacity(self) -> int:
        return self.inner.as_control().capacity

    @property
    def length(self) -> int:
        return self.inner.as_control().length

    def can_extend(self, n: int = 1) -> bool:
        return self.inner.as_control().can_extend(n)

    def clear(self) -> None:
        self.inner.as_control().clear()

    def rewind(self, new_len: int) -> bool:
        return self.inner.as_control().rewind(new_len)

    def abort_step(self) -> bool:
        return self.inner.abort_step()

    def update_and_fetch(self, layer, positions, k, v):
        if layer == 0:
            self.steps.append(len(positions))
        if len(positions) > self.MAX_STEP:
            raise StepError(f"a step of {len(positions)} tokens: this layout takes at most {self.MAX_STEP}")
        return self.inner.update_and_fetch(layer, positions, k, v)


class ThreeTokenStepsPlugin:
    @hookimpl
    def kvlayout_builders(self):
        return [Builder("test", "three", ThreeTokenSteps, "a seq-like layout taking 3 tokens a step")]


PLUGIN = ThreeTokenStepsPlugin()


@pytest.fixture
def three_installed(fake_dists):
    """test:three, installed as a distribution whose entry point is PLUGIN above."""
    fake_dists.add("kvlayout-test-three", "0.1.0", {"three": f"{__name__}:PLUGIN"}, {})
    assert kvlayout.resolve("test", "three").distribution == "kvlayout-test-three"


def test_a_third_party_seq_layout_gets_steps_within_its_own_rule_and_the_same_tokens(
    three_installed, tiny_loaded, tiny_dir
):
    requests = [{"prompt": SYSTEM + q, "max_tokens": 8, "n": 2} for q in QUESTIONS]
    # A chunk of 16 is what the shipped seq layout takes on this model (no ring layer bounds it).
    shipped = job.run(
        make_config(tiny_dir, "mlx:seq", requests=requests, engine={"prefill_chunk": 16}), loaded=tiny_loaded
    )
    cfg = make_config(tiny_dir, "test:three", requests=requests, engine={"prefill_chunk": 16})
    prepared = job.prepare(cfg, loaded=tiny_loaded)
    result = prepared.generate()
    assert isinstance(prepared.cache, ThreeTokenSteps)
    assert max(prepared.cache.steps) == 3  # the prompts were split in steps of 3, never more
    assert result.stats.failed_forwards == 0
    assert sum(prepared.cache.steps) == result.stats.prefill_tokens + result.stats.decode_tokens
    assert token_ids(result) == token_ids(shipped)
    assert all(s.finish_reason in ("stop", "length") for samples in result.outputs for s in samples)


def test_the_shipped_seq_layout_takes_max_write_tokens_a_step_past_a_narrower_window(ring_loaded, ring_dir):
    # Layer 0 slides over a window of 8; with max_write 20 its ring keeps 8 + 20 - 1 slots and
    # takes 20 tokens a step (max_step), more than the window: prompts wrap it mid-step.
    cfg = make_config(ring_dir, "mlx:seq", cache={"max_write": 20}, engine={"prefill_chunk": 64})
    prepared = job.prepare(cfg, loaded=ring_loaded)
    assert prepared.cache.as_control().max_step == 20
    steps = []
    update = prepared.cache.update_and_fetch

    def recording(layer, positions, k, v):
        if layer == 0:
            steps.append(len(positions))
        return update(layer, positions, k, v)

    prepared.cache.update_and_fetch = recording
    result = prepared.generate()
    assert max(steps) == 20
    assert token_ids(result) == oracle_outputs(ring_loaded, cfg)


class NoStepRule(ThreeTokenSteps):
    """A layout written against the older SequenceControl: its control face has no max_step."""

    def as_control(self):
        return OlderControl(self)


class OlderControl:
    def __init__(self, cache):
        self.capacity, self.length = cache.capacity, cache.length
        self.can_extend, self.clear, self.rewind = cache.can_extend, cache.clear, cache.rewind


class NoStepRulePlugin:
    @hookimpl
    def kvlayout_builders(self):
        return [Builder("test", "old", NoStepRule, "a seq-like layout without max_step")]


OLD = NoStepRulePlugin()


def test_a_layout_whose_face_lacks_a_member_is_refused_before_the_run_naming_it(fake_dists, tiny_dir, capsys):
    fake_dists.add("kvlayout-test-old", "0.1.0", {"old": f"{__name__}:OLD"}, {})
    from kvlayout import cli

    config = tiny_dir / "old.toml"
    config.write_text(f'[layout]\nbackend = "test"\nkind = "old"\n[model]\npath = "{tiny_dir}"\n'
                      '[[requests]]\nprompt = "Q: a KV cache?"\nmax_tokens = 2\n')
    assert cli.main(["run", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == (
        "kvlayout: error: layout test:old (kvlayout-test-old 0.1.0): its SequenceControl face lacks max_step"
    )
