"""ZeRO stages 1 and 2 over ranks with the model on a device (zoe.torch.zero_places.DevicePlace),
on the adversarial CPU twin: 2 ranks spawned over gloo train the model of test_torch_zero (uneven
parameters cut by the shards, one without a gradient on odd steps, a non-finite step) and must end
with the bits of the same run with the model on the CPU, whose sharded path is checked against one
process there. A gradient copy or a parameter copy failing on one rank makes every rank raise,
naming it, with every rank's parameters and state as before the step; training then goes on as a
run that never took that batch. The adversarial twin delays every copy and fills its destination
with NaN until it ends, so a missing wait would show here as NaN or wrong values."""

import os

import pytest
import torch
import torch.distributed as dist

import zoe
from conftest import gloo_rank, spawn_ranks
from test_torch_device import FailingTwin
from test_torch_zero import (EXTERNAL_WRITE_STEP, Net, batch, make_optimizer, model_of,
                             small_config)
from zoe.torch.device import HostTwin
from zoe.torch.distributed import REDUCTIONS_IN_FLIGHT

WORLD = 2
STEPS = 10  # test_torch_zero's NAN_STEP (7) among them
JOIN_SECONDS = 120
# Per fault run: the step whose copy fails, the buckets' size, the rank where it fails, which of
# that rank's copies in that step fails (None: the host -> device copy of the updated shard), and
# whether the weights and the rest are two param groups. "grad-absent": with a bucket per
# parameter, rank 0's second gradient copy of step 5 is that of ``extra`` (the first parameter:
# in rank 0's shard, beside the start of l1.weight), which has no gradient on odd steps.
# "grad-groups": the first copy fails, of one group, while the other's reductions are in flight.
FAULTS = {"grad": (4, 100, 1, 2, False), "grad-absent": (5, 1, 0, 2, False),
          "grad-groups": (4, 30, 1, 1, True), "params": (4, 100, 1, None, False)}


def train(optimizer, model, rank, steps):
    """test_torch_zero.train over the given steps (the rank's rows of each batch)."""
    dtype = next(model.parameters()).dtype
    for step in steps:
        if step == EXTERNAL_WRITE_STEP:  # as load_state_dict between steps, on every rank
            with torch.no_grad():
                model.l1.weight.mul_(0.5)
        x, y = (values.to(dtype) for values in batch(step))
        world = dist.get_world_size()
        rows = slice(rank * len(x) // world, (rank + 1) * len(x) // world)
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x[rows], step).float(), y[rows].float())
        loss.backward()
        optimizer.step()


def sharded(kind, out_dir, name, stage, backend=None, bucket_elements=100, groups=False):
    """A model of ``kind`` and its zoe optimizer sharded over the world, stepping through
    ``backend`` (a twin: the model stands for one on a device) or on the CPU; ``groups``: the
    weights and the rest in two param groups."""
    model = model_of(kind)
    params = list(model.parameters())
    if groups:
        params = [{"params": [p for p in params if p.dim() > 1]},
                  {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0}]
    optimizer = make_optimizer(kind, params, os.path.join(out_dir, name + "-{rank}"),
                               process_group=dist.group.WORLD, zero_stage=stage,
                               bucket_elements=bucket_elements, device_backend=backend)
    return model, optimizer


def params_of(model):
    return [p.detach().clone() for p in model.parameters()]


def run_training(rank, out_dir, name, kind, stage, options):
    """The run on the adversarial twin and on the CPU; both results saved."""
    results = {}
    for place, backend in (("twin", HostTwin(adversarial=True)), ("cpu", None)):
        model, optimizer = sharded(kind, out_dir, f"{name}-{place}", stage, backend, **options)
        train(optimizer, model, rank, range(STEPS))
        results[place] = {"params": params_of(model), "state": optimizer.state_dict()["state"],
                          "skipped": [step.skipped for step in optimizer.last_step]}
        if backend is not None:
            results[place]["in_flight"] = backend.in_flight()
            results[place]["device_groups"] = [s.device for s in optimizer._groups]
            buffers = optimizer._zero.device_buffers
            results[place]["bucket_buffers"] = (len(buffers._free), buffers.unreserved)
        optimizer.close()
    torch.save(results, os.path.join(out_dir, f"{name}-rank{rank}.pt"))


def run_checkpoint(rank, out_dir):
    """5 steps on the twin, a sharded checkpoint, a fresh model and optimizer on the twin that
    load it, 5 more steps: the bits of 10 steps straight."""
    model, optimizer = sharded("AdamW", out_dir, "straight", 2, HostTwin(adversarial=True))
    train(optimizer, model, rank, range(STEPS))
    straight = params_of(model)
    optimizer.close()
    model, optimizer = sharded("AdamW", out_dir, "first", 2, HostTwin(adversarial=True))
    train(optimizer, model, rank, range(5))
    optimizer.save_checkpoint(os.path.join(out_dir, "ckpt"))
    snapshot = {key: value.clone() for key, value in model.state_dict().items()}
    optimizer.close()
    model = Net()
    model.load_state_dict(snapshot)
    model, optimizer = model, make_optimizer(
        "AdamW", model.parameters(), os.path.join(out_dir, "second-{rank}"),
        process_group=dist.group.WORLD, zero_stage=2, bucket_elements=100,
        device_backend=HostTwin(adversarial=True))
    optimizer.load_checkpoint(os.path.join(out_dir, "ckpt"))
    train(optimizer, model, rank, range(5, STEPS))
    equal = [torch.equal(a, b) for a, b in zip(params_of(model), straight)]
    optimizer.close()
    torch.save(equal, os.path.join(out_dir, f"ckpt-rank{rank}.pt"))


class FailingToDevice(HostTwin):
    """An adversarial twin whose host -> device copies raise while ``failing``."""

    def __init__(self):
        super().__init__(adversarial=True)
        self.failing = False

    def copy_to_device(self, src, dst):
        if self.failing:
            raise RuntimeError("injected copy failure")
        return super().copy_to_device(src, dst)


def run_fault(rank, out_dir, which):
    """The copy of FAULTS[which] fails: every rank raises, nothing changed (a gradient's)
    or only the state (the updated shard's); after a gradient's, the run goes on and ends as one
    that skipped that batch."""
    failed_step, bucket_elements, failing, copy, groups = FAULTS[which]
    backend = HostTwin(adversarial=True)
    if rank == failing:
        backend = FailingToDevice() if copy is None else FailingTwin(fail_from=10 ** 9)
    model, optimizer = sharded("AdamW", out_dir, f"fault-{which}", 2, backend,
                               bucket_elements=bucket_elements, groups=groups)
    train(optimizer, model, rank, range(failed_step))
    before = params_of(model)
    state_before = optimizer.state_dict()["state"]
    if rank == failing and copy is not None:
        backend.fail_from = backend.to_host + copy
    if rank == failing and copy is None:
        backend.failing = True
    try:
        train(optimizer, model, rank, [failed_step])
        error = None
    except zoe.Error as caught:
        error = (type(caught).__name__, str(caught))
    backend.failing = False
    unchanged = [torch.equal(a, b) for a, b in zip(params_of(model), before)]
    state_unchanged = _same_state(optimizer.state_dict()["state"], state_before)
    if copy is not None:
        train(optimizer, model, rank, range(failed_step + 1, STEPS))
    after = params_of(model)
    optimizer.close()
    torch.save({"error": error, "unchanged": unchanged, "state_unchanged": state_unchanged,
                "after": after}, os.path.join(out_dir, f"fault-{which}-rank{rank}.pt"))


def _same_state(a, b):
    return sorted(a) == sorted(b) and all(
        torch.equal(torch.as_tensor(a[i][key]), torch.as_tensor(b[i][key]))
        for i in a for key in a[i])


def run_skipping(rank, out_dir, which):
    """The CPU run that never took the batch whose copy fails in FAULTS[which]."""
    failed_step, groups = FAULTS[which][0], FAULTS[which][4]
    model, optimizer = sharded("AdamW", out_dir, f"skipping-{which}", 2, groups=groups)
    train(optimizer, model, rank, [s for s in range(STEPS) if s != failed_step])
    torch.save(params_of(model), os.path.join(out_dir, f"skipping-{which}-rank{rank}.pt"))
    optimizer.close()


def worker(rank, init_file, out_dir, runs, world):
    with gloo_rank(rank, world, init_file, out_dir):
        for run in runs:
            if run[0] == "ckpt":
                run_checkpoint(rank, out_dir)
            elif run[0] == "fault":
                run_fault(rank, out_dir, run[1])
            elif run[0] == "skipping":
                run_skipping(rank, out_dir, run[1])
            else:
                run_training(rank, out_dir, *run)


def spawn(out_dir, runs, world=WORLD):
    spawn_ranks(worker, (os.path.join(out_dir, "init"), out_dir, runs, world), world, out_dir,
                JOIN_SECONDS)


# (name, kind, stage, sharded()'s options): buckets of 100 elements or more, and buckets of
# every parameter's own size (30: 943, 41, 287 and 14 elements) over two param groups.
TRAINING = [("s1", "AdamW", 1, {}), ("s2", "AdamW", 2, {}), ("bf16", "AdamW:bfloat16", 2, {}),
            ("lion-s2", "Lion", 2, {}),
            ("groups-s1", "AdamW", 1, {"bucket_elements": 30, "groups": True}),
            ("groups-s2", "AdamW", 2, {"bucket_elements": 30, "groups": True})]
# On 3 ranks (shards of 428, 428 and 429 elements) in gather rounds of 107 elements per rank: the
# last round has nothing from ranks 0 and 1.
TRAINING_3 = [("s2-3", "AdamW", 2, {"bucket_elements": 107}),
              ("s1-3", "AdamW", 1, {"bucket_elements": 107})]


@pytest.mark.parametrize("world", [2, 3])
def test_device_model_trains_as_the_cpu_model(nvme_dir, world):
    training = TRAINING if world == 2 else TRAINING_3
    spawn(nvme_dir, training + ([("ckpt",)] if world == 2 else []), world)
    for name, _, _, options in training:
        for rank in range(world):
            got = torch.load(os.path.join(nvme_dir, f"{name}-rank{rank}.pt"))
            twin, cpu = got["twin"], got["cpu"]
            groups = 2 if options.get("groups") else 1
            assert twin["in_flight"] == 0  # every copy was ended by ready() or wait()
            assert twin["device_groups"] == [None] * groups  # the sharded place, not DeviceGroup
            assert not any(twin["skipped"])
            # the groups share the bucket buffers reserved for the reductions in flight, and
            # backward needed no other
            free, unreserved = twin["bucket_buffers"]
            assert 0 < free <= REDUCTIONS_IN_FLIGHT + 1 and unreserved == 0, (name, free)
            for index, (a, b) in enumerate(zip(twin["params"], cpu["params"])):
                assert bool(torch.isfinite(a).all()), f"{name}: rank {rank} param {index}"
                assert torch.equal(a, b), f"{name}: rank {rank} param {index}"
            for index, entry in cpu["state"].items():
                for key, values in entry.items():
                    assert torch.equal(torch.as_tensor(twin["state"][index][key]),
                                       torch.as_tensor(values)), (name, rank, index, key)
    if world == 2:
        for rank in range(world):
            assert all(torch.load(os.path.join(nvme_dir, f"ckpt-rank{rank}.pt")))


@pytest.mark.parametrize("which", sorted(FAULTS))
def test_a_copy_failing_on_one_rank_fails_every_rank_and_changes_nothing(nvme_dir, which):
    spawn(nvme_dir, [("fault", which), ("skipping", which)])
    grad = "the device -> host copy of a reduced gradient failed"
    messages = {"grad": grad, "grad-absent": grad, "grad-groups": grad,
                "params": "the host -> device copy of the updated shard failed"}
    for rank in range(WORLD):
        got = torch.load(os.path.join(nvme_dir, f"fault-{which}-rank{rank}.pt"))
        assert got["error"] is not None, f"rank {rank} did not raise"
        kind, message = got["error"]
        failing = FAULTS[which][2]
        assert kind == ("IoError" if rank == failing else "Aborted"), got["error"]
        assert f"failed on rank {failing}" in message and messages[which] in message, message
        if which != "params":
            assert all(got["unchanged"]) and got["state_unchanged"], rank
            skipping = torch.load(os.path.join(nvme_dir, f"skipping-{which}-rank{rank}.pt"))
            for index, (a, b) in enumerate(zip(got["after"], skipping)):
                assert torch.equal(a, b), f"rank {rank} param {index} after the failed step"
        else:
            # zoe took the step (the state moved) and no rank's parameters did
            assert all(got["unchanged"]) and not got["state_unchanged"], rank


def test_a_transport_that_cannot_reach_the_parameters_is_refused():
    from types import SimpleNamespace

    from zoe.torch.zero_places import check_transport

    over_nccl = SimpleNamespace(device=torch.device("cuda"))
    with pytest.raises(zoe.InvalidArgument, match="param group 3 is on cpu; its gradients are "
                                                  "reduced and its parameters gathered there, "
                                                  r"which needs a process group over a CPU "
                                                  r"backend \(gloo\)"):
        check_transport(over_nccl, torch.device("cpu"), 3)
    check_transport(SimpleNamespace(device=torch.device("cpu")), torch.device("cpu"), 0)


def test_a_param_group_on_another_gpu_than_nccls_is_refused_naming_set_device(monkeypatch):
    from types import SimpleNamespace

    from zoe.torch.zero_places import check_transport

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    with pytest.raises(zoe.InvalidArgument, match=r"param group 1 is on cuda:1 and NCCL works on "
                                                  r"the current CUDA device, cuda:0: call "
                                                  r"torch.cuda.set_device\(1\)"):
        check_transport(SimpleNamespace(device=torch.device("cuda")), torch.device("cuda", 1), 1)
    check_transport(SimpleNamespace(device=torch.device("cuda")), torch.device("cuda", 0), 1)


def test_staging_without_swap_space_is_a_clear_error_and_changes_nothing(nvme_dir):
    """A sharded device group's staging (a zoe tensor in HOST) that the engine has no room for:
    NoSpace naming the settings at the first step, before the group's state is created, so that
    the step tried again fails alike (not on a name taken by the first try)."""
    from test_device_waits import one_rank_group

    config = small_config(nvme_dir, tensor_swap_bytes="4K", chunk_size="4K")
    with zoe.Engine(config) as engine, one_rank_group() as group:
        model = Net()
        optimizer = zoe.torch.AdamW(model.parameters(), engine=engine, process_group=group,
                                    zero_stage=2, device_backend=HostTwin(adversarial=True))
        before = params_of(model)
        for _ in range(2):
            with pytest.raises(zoe.NoSpace, match="staging of param group 0 .*tensor_swap_bytes"):
                train(optimizer, model, 0, [0])
            assert all(torch.equal(a, b) for a, b in zip(params_of(model), before))
            assert optimizer._groups[0].shard.sharded is None
        optimizer.close()


def test_a_sharded_optimizer_sizes_its_own_engine_for_the_staging():
    from test_device_waits import one_rank_group

    with one_rank_group() as group:
        model = Net()
        optimizer = zoe.torch.AdamW(model.parameters(), process_group=group, zero_stage=1,
                                    device_backend=HostTwin(adversarial=True))
        train(optimizer, model, 0, range(2))
        assert optimizer.last_step[0].steps_taken == 2
        optimizer.close()


@pytest.mark.parametrize("given, bucket_elements, expected", [
    (None, 100, 100), (None, 1, 1 << 22), (None, 1 << 30, 1 << 22), ("auto", 0, 1 << 22),
    (300, 100, 300), (5e8, 100, 500_000_000)])
def test_gather_rounds_follow_allgather_bucket_size(nvme_dir, given, bucket_elements, expected):
    """A device group's parameter gather moves, per rank and round, the configuration's
    allgather_bucket_size shared by the ranks (one rank here); absent or "auto", the buckets'
    size, capped at 4 Mi, and 4 Mi for buckets of one parameter."""
    from test_device_waits import one_rank_group

    config = small_config(nvme_dir)
    if given is not None:
        config["zero_optimization"]["allgather_bucket_size"] = given
    with one_rank_group() as group:
        optimizer = zoe.torch.AdamW(Net().parameters(), config=config, process_group=group,
                                    zero_stage=2, bucket_elements=bucket_elements,
                                    device_backend=HostTwin(adversarial=True))
        assert optimizer._groups[0].shard.place.round_elements == expected
        optimizer.close()
    config["zero_optimization"]["allgather_bucket_size"] = -1
    with one_rank_group() as group, pytest.raises(
            zoe.InvalidArgument, match="zero_optimization.allgather_bucket_size"):
        zoe.torch.AdamW(Net().parameters(), config=config, process_group=group, zero_stage=2)


def test_an_empty_param_group_beside_a_device_one_is_left_alone():
    from test_device_waits import one_rank_group

    with one_rank_group() as group:
        model = Net()
        optimizer = zoe.torch.AdamW([{"params": list(model.parameters())}, {"params": []}],
                                    process_group=group, zero_stage=2,
                                    device_backend=HostTwin(adversarial=True))
        train(optimizer, model, 0, [0])
        assert optimizer.last_step[0].steps_taken == 1 and optimizer.last_step[1] is None
        optimizer.close()
