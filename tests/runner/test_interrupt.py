"""StopOnCtrlC: the first Ctrl-C asks the run to stop after its step, a second interrupts a
forward, a third anything; held_while_saving: a Ctrl-C waits for the save, a second abandons it."""

from __future__ import annotations

import signal
import sys

import numpy as np
import pytest

from kvlayout.engines.recovery import guarded_forward
from kvlayout.runner.interrupt import StopOnCtrlC, held_while_saving, in_forward


def test_the_first_ctrl_c_asks_to_stop_a_second_between_forwards_is_answered_and_a_third_interrupts(capsys):
    with StopOnCtrlC() as stop:
        assert signal.getsignal(signal.SIGINT) == stop.handle
        assert stop() is False
        stop.handle(signal.SIGINT, sys._getframe())
        assert stop() is True
        stop.handle(signal.SIGINT, sys._getframe())  # not in a forward: the step ends in moments anyway
        assert "Ctrl-C again to quit without saving it" in capsys.readouterr().err
        with pytest.raises(KeyboardInterrupt):
            stop.handle(signal.SIGINT, sys._getframe())
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_second_ctrl_c_inside_a_forward_interrupts_it():
    seen = []

    def model(tokens, positions, cache, rows):
        seen.append(in_forward(sys._getframe()))
        stop.handle(signal.SIGINT, sys._getframe())
        return np.zeros((1, 4))

    with StopOnCtrlC() as stop:
        stop.handle(signal.SIGINT, None)
        with pytest.raises(KeyboardInterrupt):
            guarded_forward(model, object(), [1], [0], [0])
    assert seen == [True] and not in_forward(sys._getframe())


def test_a_ctrl_c_while_saving_is_held_and_a_second_abandons_the_save(capsys):
    with StopOnCtrlC() as stop:
        with pytest.raises(KeyboardInterrupt):
            with held_while_saving("kvlayout: saving; Ctrl-C again abandons it"):
                signal.raise_signal(signal.SIGINT)  # held: the save goes on
                assert capsys.readouterr().err.strip() == "kvlayout: saving; Ctrl-C again abandons it"
                signal.raise_signal(signal.SIGINT)
                raise AssertionError("the second Ctrl-C did not interrupt the save")
        assert signal.getsignal(signal.SIGINT) == stop.handle  # the run's handler is back
        assert stop() is False  # and the held Ctrl-C did not count as a request to stop
