"""A net under every wait of zoe.torch's device path: each wait named in zoe.torch.device.WAITS is
left out in turn (_SKIPPED_WAITS_FOR_TESTING), and a scenario that passes with every wait fails
without it on the adversarial twin (wrong values or NaN), while the plain twin, whose copies
complete at once, misses it. The table of waits is checked against the module's source, so a
wait cannot be added without a case here."""

import ast
import contextlib
import inspect
import tempfile

import pytest
import torch
import torch.distributed as dist

import zoe
import zoe.torch
from conftest import small_config
from test_optim import assert_params_close, batch, make_model
from test_torch_device import FailingTwin
from zoe.torch import device as torch_device
from zoe.torch import zero_places
from zoe.torch.device import HostTwin

STEPS = 3


@pytest.fixture
def engine(nvme_dir):
    with zoe.Engine(small_config(nvme_dir)) as e:
        yield e


def optimizers(engine, backend, **options):
    """A model on the twin with zoe's AdamW, and the same model with torch's on the CPU."""
    model, reference = make_model(), make_model()
    zoe_opt = zoe.torch.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, engine=engine,
                              device_backend=backend, **options)
    torch_opt = torch.optim.AdamW(reference.parameters(), lr=3e-3, weight_decay=0.1)
    return model, zoe_opt, reference, torch_opt


def train_step(model, optimizer, step, overlapped):
    optimizer.zero_grad(set_to_none=True)
    x, y = batch(step)
    loss = torch.nn.functional.mse_loss(model(x), y)
    with optimizer.overlap() if overlapped else contextlib.nullcontext():
        loss.backward()
    optimizer.step()


def assert_same(model, reference):
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters()), "NaN parameters"
    assert_params_close(model, reference)


def training(overlapped, speculative=False):
    """STEPS steps on the twin, each compared with torch's."""

    def scenario(engine, adversarial):
        backend = HostTwin(adversarial=adversarial)
        model, zoe_opt, reference, torch_opt = optimizers(engine, backend,
                                                          speculative=speculative)
        for step in range(STEPS):
            train_step(reference, torch_opt, step, False)
            train_step(model, zoe_opt, step, overlapped)
            assert_same(model, reference)
        zoe_opt.close()
        assert backend.in_flight() == 0  # every copy was ended by ready() or wait()
        backend.synchronize()  # a copy left in flight would land now
        assert_same(model, reference)

    return scenario


def retry_after_a_failed_copy(engine, adversarial):
    """The fifth gradient copy of the second step fails in an overlapped backward (copies are
    in flight); the step is retried on the next batch, which torch's optimizer takes instead."""
    backend = FailingTwin(fail_from=len(list(make_model().parameters())) + 5,
                          adversarial=adversarial)
    model, zoe_opt, reference, torch_opt = optimizers(engine, backend)
    train_step(reference, torch_opt, 0, False)
    train_step(model, zoe_opt, 0, True)
    with pytest.raises(zoe.IoError, match="injected copy failure"):
        train_step(model, zoe_opt, 1, True)
    backend.failing = False
    for step in (2, 3):
        train_step(reference, torch_opt, step, False)
        train_step(model, zoe_opt, step, True)
        assert_same(model, reference)
    zoe_opt.close()


def close_then_reuse_the_staging(engine, adversarial):
    """Once close() released the staging, zoe may give its memory to another tensor (here: it is
    overwritten); the parameters must not change."""
    backend = HostTwin(adversarial=adversarial)
    model, zoe_opt, reference, torch_opt = optimizers(engine, backend)
    for step in range(2):
        train_step(reference, torch_opt, step, False)
        train_step(model, zoe_opt, step, True)
    group = zoe_opt._groups[0].device
    staging = group._param_host + group._grad_host
    zoe_opt.close()
    assert group._staging is None  # released
    for values in staging:
        values.fill_(7.0)
    backend.synchronize()
    assert_same(model, reference)


@contextlib.contextmanager
def one_rank_group():
    """A gloo process group of this process alone, for the twin's sharded path (DevicePlace)."""
    with tempfile.TemporaryDirectory() as directory:
        dist.init_process_group("gloo", init_method=f"file://{directory}/init", rank=0,
                                world_size=1)
        try:
            yield dist.group.WORLD
        finally:
            dist.destroy_process_group()


def sharded_training(engine, adversarial):
    """STEPS steps of ZeRO stage 2 over one rank on the twin, each compared with torch's."""
    backend = HostTwin(adversarial=adversarial)
    with one_rank_group() as group:
        model, zoe_opt, reference, torch_opt = optimizers(engine, backend, process_group=group,
                                                          zero_stage=2, bucket_elements=64)
        for step in range(STEPS):
            train_step(reference, torch_opt, step, False)
            train_step(model, zoe_opt, step, False)
            assert_same(model, reference)
        zoe_opt.close()
    assert backend.in_flight() == 0
    backend.synchronize()
    assert_same(model, reference)


# Per wait of zoe.torch.device.WAITS: a scenario that needs it.
SCENARIOS = {
    "grad_poll": training(overlapped=True),
    "grad_copy": training(overlapped=False),
    "abandon": retry_after_a_failed_copy,
    "speculate": training(overlapped=True, speculative=True),
    "step": training(overlapped=False),
    "write_back": training(overlapped=False),
    "close": close_then_reuse_the_staging,
    "shard_grad": sharded_training,
    "shard_params": sharded_training,
}


_WAIT_METHODS = {"ready", "wait", "wait_current"}  # DeviceBackend's


def test_every_wait_of_the_device_path_is_named_and_has_a_scenario():
    # Every call of a DeviceBackend wait in zoe.torch.device or zero_places outside _wait() is a
    # wait without a name; every name of WAITS is used at one place, and has a scenario here.
    named, direct = [], []
    functions = [function for module in (torch_device, zero_places)
                 for function in ast.walk(ast.parse(inspect.getsource(module)))]
    for function in functions:
        if not isinstance(function, ast.FunctionDef) or function.name == "_wait":
            continue
        for call in ast.walk(function):
            if not isinstance(call, ast.Call):
                continue
            callee = call.func
            if isinstance(callee, ast.Name) and callee.id == "_wait":
                named.append(call.args[2].value)
            elif (isinstance(callee, ast.Attribute) and callee.attr in _WAIT_METHODS
                  and isinstance(callee.value, ast.Attribute) and callee.value.attr == "backend"):
                direct.append(f"line {call.lineno}: backend.{callee.attr}")
    assert direct == []  # every wait goes through _wait(), by a name of WAITS
    assert sorted(named) == sorted(torch_device.WAITS)  # each name at one place
    assert set(torch_device.WAITS.values()) == _WAIT_METHODS
    assert sorted(SCENARIOS) == sorted(torch_device.WAITS)
    assert torch_device._SKIPPED_WAITS_FOR_TESTING == frozenset()


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_the_scenario_passes_with_every_wait(engine, name):
    SCENARIOS[name](engine, adversarial=True)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_the_adversarial_twin_catches_the_wait_left_out(engine, name, monkeypatch):
    monkeypatch.setattr(torch_device, "_SKIPPED_WAITS_FOR_TESTING", frozenset({name}))
    with pytest.raises(AssertionError):
        SCENARIOS[name](engine, adversarial=True)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_the_plain_twin_misses_the_wait_left_out(engine, name, monkeypatch):
    monkeypatch.setattr(torch_device, "_SKIPPED_WAITS_FOR_TESTING", frozenset({name}))
    SCENARIOS[name](engine, adversarial=False)
