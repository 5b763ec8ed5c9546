"""StopOnCtrlC: the first Ctrl-C asks the run to stop after its step, the second interrupts."""

from __future__ import annotations

import signal

import pytest

from kvlayout.runner.interrupt import StopOnCtrlC


def test_the_first_ctrl_c_asks_to_stop_and_the_second_interrupts():
    with StopOnCtrlC() as stop:
        assert signal.getsignal(signal.SIGINT) == stop.handle
        assert stop() is False
        stop.handle(signal.SIGINT, None)
        assert stop() is True
        with pytest.raises(KeyboardInterrupt):
            stop.handle(signal.SIGINT, None)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
