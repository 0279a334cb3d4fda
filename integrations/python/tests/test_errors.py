"""Failures surface as zoe.Error subclasses carrying the status code and a message that names what
was wrong: bad paths, no space, bad configuration keys, wrong dtypes, use after close."""

import pytest
import torch

import zoe
import zoe.torch
from conftest import small_config


def test_every_status_has_its_own_class():
    classes = {zoe.errors.error_for(code, "m").__class__ for code in range(1, 13)}
    assert len(classes) == 12
    error = zoe.errors.error_for(zoe._capi.Status.NO_SPACE, "full")
    assert isinstance(error, zoe.NoSpace) and isinstance(error, zoe.Error)
    assert error.code == 4 and error.message == "full" and str(error) == "full"
    assert type(zoe.errors.error_for(99, "?")) is zoe.Error


def test_bad_config_key_names_the_closest_key():
    config = {"zero_optimization": {"offload_optimizer": {"device": "cpu", "nvme_pth": "/x"}}}
    with pytest.raises(zoe.InvalidArgument) as raised:
        zoe.Engine(config)
    assert "nvme_pth" in str(raised.value) and "nvme_path" in str(raised.value)
    assert raised.value.code == zoe._capi.Status.INVALID_ARGUMENT
    assert isinstance(raised.value, ValueError)


def test_malformed_json_names_the_position():
    with pytest.raises(zoe.InvalidArgument, match="line"):
        zoe.Engine('{"zoe": {"device": "host",}}')


def test_missing_config_file():
    with pytest.raises(zoe.NotFound, match="no-such-config.json"):
        zoe.Engine("/var/tmp/no-such-dir-zoe/no-such-config.json")


def test_a_missing_nvme_path_is_created(tmp_path):
    path = tmp_path / "not" / "yet" / "there"
    with zoe.Engine(small_config(str(path), offload="nvme")):
        assert path.is_dir()


def test_an_nvme_path_that_cannot_be_a_directory_names_the_path_and_the_key(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    config = small_config(str(blocker / "nvme"), offload="nvme")
    with pytest.raises(zoe.Error, match=r"a-file/nvme.*nvme_path"):
        zoe.Engine(config)
    config = small_config(str(blocker), offload="nvme")
    with pytest.raises(zoe.Error, match=r"a-file'.*nvme_path.*[Nn]ot a directory"):
        zoe.Engine(config)


def test_checkpoint_load_from_a_missing_directory(engine):
    with pytest.raises(zoe.NotFound, match="zoe-missing-checkpoint"):
        engine.load_checkpoint("/var/tmp/zoe-missing-checkpoint")


def test_no_space_for_a_tensor_larger_than_the_swap_space(engine):
    # small_config reserves 64 MiB of swap for tensors and a 256 MiB host budget.
    with pytest.raises(zoe.NoSpace) as raised:
        engine.register_tensor("big", 128 << 20, zoe.DType.UINT8, zoe.Tier.NVME)
    assert "big" in str(raised.value)


def test_out_of_memory_for_a_tensor_larger_than_the_host_budget(engine):
    with pytest.raises(zoe.OutOfMemory, match="host budget"):
        engine.register_tensor("huge", 1 << 40, zoe.DType.UINT8, zoe.Tier.HOST)


def test_unknown_tensor_and_double_registration(engine):
    with pytest.raises(zoe.NotFound, match="nope"):
        engine.find_tensor("nope")
    engine.register_tensor("t", 4096)
    with pytest.raises(zoe.InvalidArgument, match="'t'"):
        engine.register_tensor("t", 4096)


def test_wrong_dtype_parameter_is_refused():
    param = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
    with pytest.raises(zoe.InvalidArgument, match="float64"):
        zoe.torch.AdamW([param], engine=None)


def test_non_contiguous_parameter_is_refused():
    param = torch.nn.Parameter(torch.zeros(4, 4).t())
    optimizer = zoe.torch.AdamW([param])
    param.grad = torch.ones(4, 4)
    with pytest.raises(zoe.InvalidArgument, match="contiguous"):
        optimizer.step()
    optimizer.close()


def test_nvme_offload_needs_a_path():
    with pytest.raises(zoe.InvalidArgument, match="nvme_path"):
        zoe.torch.AdamW([torch.nn.Parameter(torch.zeros(4))], offload="nvme")


def test_optimizer_after_its_engine_closed_raises():
    param = torch.nn.Parameter(torch.ones(8))
    optimizer = zoe.torch.AdamW([param])
    param.grad = torch.ones(8)
    optimizer.step()
    optimizer.close()
    with pytest.raises(zoe.FailedPrecondition, match="closed"):
        optimizer.step()


def test_trace_end_without_begin(engine):
    with pytest.raises(zoe.FailedPrecondition):
        engine.trace_end()


def test_library_search_lists_where_it_looked(monkeypatch):
    from zoe import _library

    monkeypatch.setenv("ZOE_LIBRARY", "/var/tmp/zoe-no-such/libzoe.so")
    with pytest.raises(OSError) as raised:
        _library._load_first()
    assert "/var/tmp/zoe-no-such/libzoe.so (absent)" in str(raised.value)
    assert "ZOE_LIBRARY" in str(raised.value)
    monkeypatch.delenv("ZOE_LIBRARY")
    assert any(path.endswith("integrations/libzoe.so") for path in _library.candidates())
