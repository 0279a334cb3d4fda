"""zoe.torch.common._timed: the collective timer shared by ZeRO-1/2 and ZeRO-3."""

import time

import pytest

from zoe.torch.common import _timed


class _Owner:
    def __init__(self):
        self.seconds = 0.0
        self.calls = 0


def test_timed_adds_wall_time_and_counts_calls():
    owner = _Owner()
    with _timed(owner, "seconds", calls="calls"):
        time.sleep(0.01)
    with _timed(owner, "seconds", calls="calls"):
        pass
    assert owner.calls == 2
    assert owner.seconds > 0.01


def test_timed_records_a_block_that_raises():
    owner = _Owner()
    with pytest.raises(RuntimeError):
        with _timed(owner, "seconds", calls="calls"):
            time.sleep(0.005)
            raise RuntimeError("collective failed")
    assert owner.calls == 1
    assert owner.seconds > 0.005


def test_timed_without_a_call_counter_leaves_calls_alone():
    owner = _Owner()
    with _timed(owner, "seconds"):
        pass
    assert owner.calls == 0
    assert owner.seconds > 0.0
