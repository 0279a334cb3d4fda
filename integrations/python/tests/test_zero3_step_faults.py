"""A stage 3 optimizer step (zoe.torch.AdamW over a ShardedParameterPager's shards) that fails
on one of 2 gloo ranks, in zoe's step or in writing the updated shard back: every rank raises,
naming the failing rank, well within the process group's timeout, and the ranks stay paired:
a collective right after pairs up, and the next training step runs on both (after a failed
write-back, which left rank 1's group partly stepped, once every rank loaded the checkpoint
saved before: the group refuses to step until then)."""

import os
import time
import traceback

import pytest
import torch
import torch.distributed as dist

import zoe
import zoe.torch
from test_zero3 import LR, Model, engine_for, init, loss_of, run_ranks

TIMEOUT_S = 60  # the process group's; the failure must take < 1/3 of it
FAULTS = {
    "step": "IoError: injected: reading the optimizer state failed",
    "write-back": "NoSpace: injected: no HOST memory to write the shard",
}


def arm(fault, optimizer, pager):
    """Makes this rank's next optimizer step fail as ``fault`` says."""
    if fault == "step":
        zoe_group = optimizer._groups[0].zoe_group

        def failing_step(*args, **kwargs):
            raise zoe.IoError(zoe.IoError.status, FAULTS[fault].split(": ", 1)[1])

        zoe_group.step = failing_step
        return
    hold = pager._hold

    def failing_hold(record, access):
        if access == zoe.Access.WRITE:
            raise zoe.NoSpace(zoe.NoSpace.status, FAULTS[fault].split(": ", 1)[1])
        return hold(record, access)

    pager._hold = failing_hold


def step_fails_on_rank_1(rank, world_size, directory, fault):
    """Step 0 trains and is saved; rank 1's step 1 fails as ``fault`` says; step 2 trains again
    (after a write-back failure, from the checkpoint, and not before: rank 1 refuses it). Each
    rank writes how long step 1 took, the sum of a collective made after it (paired: 2), step
    1's error and whether step 2 ran."""
    init(rank, world_size, directory, timeout_s=TIMEOUT_S)
    engine, _ = engine_for(directory, rank)
    torch.manual_seed(0)
    model = Model()
    pager = zoe.torch.offload_parameters(model, engine, process_group=dist.group.WORLD)
    optimizer = zoe.torch.AdamW(pager.shard_parameters(), lr=LR, weight_decay=0.01,
                                engine=engine)
    rows = slice(rank, rank + 1)

    def train_step(step):
        optimizer.zero_grad(set_to_none=True)
        loss_of(model, step, rows).backward()
        optimizer.step()

    train_step(0)
    checkpoint = os.path.join(directory, "checkpoint")
    pager.save_checkpoint(checkpoint, optimizer)
    if rank == 1:
        arm(fault, optimizer, pager)
    start = time.monotonic()
    outcome = "no error"
    try:
        train_step(1)
    except Exception as error:  # the outcome under test
        outcome = f"{type(error).__name__}: {error}"
        traceback.print_exc()
    seconds = time.monotonic() - start
    paired = torch.ones(1)
    dist.all_reduce(paired)
    if rank == 1:  # the fault is gone
        optimizer._groups[0].zoe_group.__dict__.pop("step", None)
        pager.__dict__.pop("_hold", None)
    if fault == "write-back":
        try:
            train_step(2)
            raise AssertionError("a partly stepped group stepped again")
        except zoe.Error as error:
            assert "partly stepped" in str(error) or rank == 0, error
        pager.load_checkpoint(checkpoint, optimizer)
    train_step(2)
    with open(os.path.join(directory, f"outcome{rank}"), "w") as file:
        file.write(f"{seconds:.3f}\n{paired.item():g}\n{outcome}")
    del pager
    dist.destroy_process_group()
    engine.close()


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_step_failing_on_one_rank_fails_every_rank(nvme_dir, fault):
    run_ranks(step_fails_on_rank_1, 2, nvme_dir, fault)
    outcomes = []
    for rank in range(2):
        with open(os.path.join(nvme_dir, f"outcome{rank}")) as file:
            seconds, paired, outcome = file.read().split("\n", 2)
        outcomes.append(outcome)
        assert float(seconds) < TIMEOUT_S / 3, outcome
        assert paired == "2", (rank, paired)
    kind, message = FAULTS[fault].split(": ", 1)
    what = ("the step of optimizer 'zoe' (the ranks that did not fail took it; resume every rank "
            "from a checkpoint)")
    assert outcomes[1] == f"{kind}: {what} failed on rank 1: {message}"
    assert outcomes[0] == f"Aborted: {what} failed on rank 1 (rank 1: zoe.{kind}: {message})"
