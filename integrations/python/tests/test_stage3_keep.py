"""Which full parameters ZeRO stage 3 keeps gathered from forward to backward (stage3_keep.py):
the newest within stage3_max_live_parameters elements and stage3_max_reuse_distance, released
by backward or at the iteration's end; the DeepSpeed keys read by initialize, bad values refused
naming the key. The pager's use of it is tested on 2 and 3 ranks in test_zero3.py."""

import pytest

import zoe
from zoe.torch.ds_stage3 import keep_settings
from zoe.torch.stage3_keep import KeptForBackward


def test_the_newest_parameters_are_kept_within_the_live_elements():
    keep = KeptForBackward(max_live_parameters=250, max_reuse_distance=10**9)
    assert keep.keep("a", 100) == [] and keep.keep("b", 100) == []
    assert keep.keep("c", 100) == ["a"]  # 300 > 250: the oldest goes first
    assert "a" not in keep and "b" in keep and "c" in keep
    assert keep.keep("huge", 1000) == ["b", "c", "huge"]  # alone above the limit: not kept


def test_a_parameter_is_released_once_forward_finished_more_than_the_distance_after_it():
    keep = KeptForBackward(max_live_parameters=10**9, max_reuse_distance=150)
    assert keep.keep("a", 100) == [] and keep.keep("b", 100) == []  # 100 after a: kept
    assert keep.keep("c", 60) == ["a"]  # 160 after a, 60 after b
    assert "b" in keep


def test_parameters_not_kept_count_in_the_distance():
    keep = KeptForBackward(max_live_parameters=10**9, max_reuse_distance=150)
    keep.keep("a", 100)
    assert keep.finished(100) == []  # a bias forward finished, not kept: 100 after a
    assert keep.finished(60) == ["a"]  # 160 after a
    assert keep.finished(10**6) == []


def test_kept_again_moves_to_the_newest_and_counts_once():
    keep = KeptForBackward(max_live_parameters=200, max_reuse_distance=10**9)
    keep.keep("tied", 100)
    keep.keep("b", 100)
    assert keep.keep("tied", 100) == []  # still 200 elements: tied is counted once
    assert keep.keep("c", 100) == ["b"]  # tied is now newer than b


def test_backward_and_the_iterations_end_release_them():
    keep = KeptForBackward(max_live_parameters=250, max_reuse_distance=150)
    keep.keep("a", 100)
    keep.keep("b", 100)
    assert keep.release("b") and not keep.release("b") and not keep.release("never")
    assert keep.release_all() == ["a"] and "a" not in keep
    # the next iteration starts over: its distances count from its own first parameter
    assert keep.keep("c", 100) == [] and keep.keep("d", 100) == []


@pytest.mark.parametrize("limits", [(0, 10**9), (10**9, 0), (0, 0)])
def test_either_limit_at_zero_keeps_nothing(limits):
    assert not KeptForBackward(*limits).enabled
    assert KeptForBackward(10**9, 10**9).enabled


def test_deepspeed_keys_and_their_defaults_within_a_quarter_of_the_budget():
    ample = 64 << 30  # bytes of the memory the full parameters are gathered in
    assert keep_settings({}, ample, 4) == {"max_live_parameters": 10**9,
                                           "max_reuse_distance": 10**9}
    # A budget of 1 GiB: at most 256 MiB kept, 64 Mi fp32 elements or 128 Mi bf16 ones
    assert keep_settings({}, 1 << 30, 4)["max_live_parameters"] == 64 << 20
    assert keep_settings({}, 1 << 30, 2)["max_live_parameters"] == 128 << 20
    zero = {"stage3_max_live_parameters": 3e7, "stage3_max_reuse_distance": "auto"}
    assert keep_settings({"zero_optimization": zero}, ample, 4) == {
        "max_live_parameters": 30_000_000, "max_reuse_distance": 10**9}
    # a value given is kept as given, beyond the budget's share too
    assert keep_settings({"zero_optimization": zero}, 1 << 20, 4)["max_live_parameters"] == 3e7


@pytest.mark.parametrize("value", [-1, 1.5, "many", True])
def test_a_bad_value_is_refused_naming_the_key(value):
    document = {"zero_optimization": {"stage3_max_reuse_distance": value}}
    with pytest.raises(zoe.InvalidArgument,
                       match=r"zero_optimization.stage3_max_reuse_distance = .* integer >= 0"):
        keep_settings(document, 1 << 30, 4)
    with pytest.raises(zoe.InvalidArgument, match=r"max_live_parameters = .* integer >= 0"):
        KeptForBackward(max_live_parameters=value, max_reuse_distance=1)
