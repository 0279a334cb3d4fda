"""Streamed gradients (grad_stream.py): a zoe optimizer over paged parameters takes each gradient
out of backward as it is final, so ``.grad`` never holds it, and steps window by window from the
gradient stores, with clipping and the non-finite skip exact. 20 steps with 2 micro-batches,
clipping, a module unused on odd steps, a weight tied to another and one non-finite step equal
torch's AdamW on 1 process, on the CPU twin of a GPU model (parameters paged into the device
tier) and on 2 gloo ranks (a ShardedParameterPager); the stores spill to
NVMe and the step takes several windows; zero_grad drops what is held; a fault while writing a
gradient, reading a paged parameter, zoe's step, or reading a stored gradient back (a corrupted
swap file) is a clear error that changes nothing, or a partly stepped group that refuses to step until a
checkpoint is loaded, and the run resumed afterwards equals one never interrupted."""

import glob
import math
import os

import pytest
import torch
import torch.distributed as dist

import zoe
import zoe.torch
from test_zero3 import BATCH, LR, MAX_NORM, Model, engine_for, init, loss_of, run_ranks

STEPS = 20
MICRO = 2  # micro-batches per step
NONFINITE_STEP = 7  # the last micro-batch's loss is inf on rank 0
ROWS = [slice(0, 3), slice(3, 6)]  # rank r of 2 takes ROWS[r]; one process takes both


def micro_rows(rows, micro):
    """The rows of micro-batch ``micro`` of ``rows``."""
    indices = list(range(BATCH))[rows]
    half = len(indices) // MICRO
    return slice(indices[0] + micro * half, indices[0] + (micro + 1) * half)


def backward_micro_batches(model, step, parts, after_each=lambda: None):
    """The backwards of one step over ``parts`` (the rows this process takes), MICRO
    micro-batches each, of loss / (MICRO * len(parts)) -- per rank, as DistributedDataParallel:
    the ranks' mean makes the whole batch's; inf at NONFINITE_STEP's last micro-batch of
    ROWS[0]. ``after_each()`` after every backward."""
    for part in parts:
        for micro in range(MICRO):
            loss = loss_of(model, step, micro_rows(part, micro)) / (MICRO * len(parts))
            if step == NONFINITE_STEP and part is ROWS[0] and micro == MICRO - 1:
                loss = loss * float("inf")
            loss.backward()
            after_each()


def reference_parameters(steps=STEPS):
    """One process: torch's AdamW, accumulation over MICRO micro-batches of loss / MICRO,
    clip_grad_norm_, the non-finite step skipped."""
    torch.manual_seed(0)
    model = Model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        backward_micro_batches(model, step, ROWS)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        if math.isfinite(norm):
            optimizer.step()
    return {name: p.detach().clone() for name, p in model.state_dict().items()}


def train_steps(model, optimizer, steps, parts, first=0):
    """Steps [first, first + steps) of the streamed run over ``parts`` (this rank's rows);
    returns the skipped steps and the windows each step took."""
    def no_gradient_held():
        assert all(p.grad is None for p in model.parameters())

    skipped, windows = [], []
    for step in range(first, first + steps):
        optimizer.zero_grad(set_to_none=True)
        backward_micro_batches(model, step, parts, no_gradient_held)
        optimizer.step()
        if optimizer.last_step[0].skipped:
            skipped.append(step)
        windows.append(optimizer._groups[0].stream.last_windows)
    return skipped, windows


def streamed_setup(directory, rank=0, process_group=None, tier=None, **zoe_options):
    """A model paged (into ``tier``) through an engine with a 16 KiB HOST tier for tensors (every
    store and parameter spills to NVMe; a window holds 4 KiB; ``zoe_options`` override the
    engine's zoe section) and a zoe AdamW clipping at MAX_NORM, given the model's parameters
    (with a process group: which stand for this rank's shards)."""
    options = {**engine_for_zoe(), "tensor_host_budget": "16K", **zoe_options}
    engine, _ = engine_for(directory, rank, zoe=options)
    torch.manual_seed(0)
    model = Model()
    pager = zoe.torch.offload_parameters(model, engine, process_group=process_group, tier=tier)
    optimizer = zoe.torch.AdamW(model.parameters(), lr=LR, weight_decay=0.01, engine=engine,
                                max_grad_norm=MAX_NORM, process_group=process_group)
    return engine, model, pager, optimizer


def engine_for_zoe():
    """The zoe section engine_for gives (chunk size, budgets), to override one key of it."""
    from conftest import small_config
    return dict(small_config(None, chunk_size="4K", tensor_host_budget="64K")["zoe"])


@pytest.fixture(scope="module")
def reference():
    return reference_parameters()


def assert_matches(state, reference):
    for name, value in reference.items():
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_one_process_equals_torch_with_gradients_never_held(nvme_dir, reference):
    engine, model, pager, optimizer = streamed_setup(nvme_dir)
    with engine:
        skipped, windows = train_steps(model, optimizer, STEPS, ROWS)
        assert skipped == [NONFINITE_STEP]
        assert min(windows) > 1, windows  # the stores did not fit one window
        assert_matches(pager.state_dict(), reference)
        assert engine.stats()["links"]["host_to_nvme"]["bytes"] > 0  # the stores spilled
        optimizer.close()
        pager.remove()


def test_a_model_paged_into_the_device_tier_equals_torch(nvme_dir, reference):
    """The CPU twin of a GPU model (the engine's device tier is the host stand-in, adversarial
    in CI: its copies complete late, so a missing wait reads stale parameters): the same path,
    the same result."""
    engine, model, pager, optimizer = streamed_setup(nvme_dir, tier=zoe.Tier.DEVICE)
    with engine:
        skipped, windows = train_steps(model, optimizer, STEPS, ROWS)
        assert skipped == [NONFINITE_STEP] and min(windows) > 1
        assert_matches(pager.state_dict(), reference)
        assert engine.stats()["links"]["host_to_device"]["bytes"] > 0
        optimizer.close()
        pager.remove()


def test_gradient_stores_share_no_chunk_with_parameters_held_on_the_device(nvme_dir, reference):
    """Chunks of 64 KiB hold the whole model: gradient stores packed beside its parameters could
    not be written on the host while backward holds their module's parameters on the device (the
    CPU twin's host stand-in here, a GPU's memory there). The stores are a chunk group of their
    own, and the run equals torch."""
    engine, model, pager, optimizer = streamed_setup(nvme_dir, tier=zoe.Tier.DEVICE,
                                                     chunk_size="64K", tensor_host_budget="1M")
    with engine:
        skipped, _ = train_steps(model, optimizer, STEPS, ROWS)
        assert skipped == [NONFINITE_STEP]
        assert_matches(pager.state_dict(), reference)
        optimizer.close()
        pager.remove()


def test_a_parameter_too_large_to_sit_beside_its_gradient_store_is_written_after(nvme_dir):
    """A Linear(64, 64) whose weight and gradient store (16 KiB each, fp32) do not fit a 24 KiB
    HOST budget for tensors together, while each does alone: the step writes the weight from the
    master once its store is released instead of waiting for room that never comes, and 3 steps
    equal torch's AdamW."""
    torch.manual_seed(0)
    reference = torch.nn.Linear(64, 64)
    expected = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.01)
    engine, _ = engine_for(nvme_dir, 0, zoe={**engine_for_zoe(), "tensor_host_budget": "24K"})
    with engine:
        torch.manual_seed(0)
        model = torch.nn.Linear(64, 64)
        pager = zoe.torch.offload_parameters(model, engine)
        optimizer = zoe.torch.AdamW(model.parameters(), lr=LR, weight_decay=0.01, engine=engine)
        for step in range(3):
            x = torch.randn(4, 64, generator=torch.Generator().manual_seed(step))
            for net, opt in ((reference, expected), (model, optimizer)):
                opt.zero_grad(set_to_none=True)
                net(x).square().mean().backward()
                opt.step()
        state = pager.state_dict()
        for name, value in reference.state_dict().items():
            torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)
        optimizer.close()
        pager.remove()


def test_at_most_one_gradient_exists_at_a_time_in_backward(nvme_dir):
    """Each parameter's pre-accumulate hook sees no other paged parameter holding a gradient:
    each moved to its store as it became final (held whole, they would pile up)."""
    engine, model, pager, optimizer = streamed_setup(nvme_dir)
    with engine:
        seen = []
        params = list(model.parameters())
        for param in params:
            param.register_hook(
                lambda grad: seen.append(sum(p.grad is not None for p in params)) or grad)
        loss_of(model, 0, slice(None)).backward()
        assert seen and max(seen) == 0, seen
        assert optimizer._groups[0].stream.any_present(optimizer._groups[0].params)
        optimizer.close()
        pager.remove()


def test_zero_grad_drops_the_streamed_gradients(nvme_dir):
    """A backward, zero_grad, then one step's backward: the same as that step alone."""
    results = []
    for dropped in (False, True):
        directory = os.path.join(nvme_dir, str(dropped))
        engine, model, pager, optimizer = streamed_setup(directory)
        with engine:
            if dropped:
                loss_of(model, 5, slice(None)).backward()
                optimizer.zero_grad()
            loss_of(model, 0, slice(None)).backward()
            optimizer.step()
            results.append(pager.state_dict())
            optimizer.close()
            pager.remove()
    for name, value in results[0].items():
        assert torch.equal(results[1][name], value), name


def sharded_run(rank, world_size, directory):
    init(rank, world_size, directory)
    engine, model, pager, optimizer = streamed_setup(directory, rank, dist.group.WORLD)
    shards = {id(shard) for shard in pager.shard_parameters()}
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert stepped == shards  # the model's parameters stood for this rank's shards
    try:
        zoe.torch.AdamW(pager.model.parameters(), engine=engine, zero_stage=2)
        refusal = "accepted"
    except zoe.InvalidArgument as error:
        refusal = str(error)
    skipped, windows = train_steps(model, optimizer, STEPS, [ROWS[rank]])
    state = pager.state_dict()
    if rank == 0:
        torch.save((state, skipped, windows, refusal), os.path.join(directory, "result.pt"))
    optimizer.close()
    pager.remove()
    dist.destroy_process_group()
    engine.close()


def test_two_ranks_equal_torch_with_clipping_by_the_global_norm(nvme_dir, reference):
    """zoe.torch.AdamW(model.parameters(), process_group=pg) over a sharded model steps this
    rank's shards (asking it for ZeRO stage 2 instead is refused, naming the fix)."""
    run_ranks(sharded_run, 2, nvme_dir)
    state, skipped, windows, refusal = torch.load(os.path.join(nvme_dir, "result.pt"))
    assert "ShardedParameterPager" in refusal and "leave zero_stage unset" in refusal, refusal
    assert skipped == [NONFINITE_STEP]
    assert max(windows) > 1, windows
    assert_matches(state, reference)


# --- faults ---------------------------------------------------------------------------------


def snapshot(pager, optimizer):
    return pager.state_dict(), optimizer.state_dict()


def assert_same_snapshot(before, after):
    for name, value in before[0].items():
        assert torch.equal(after[0][name], value), name
    for index, entry in before[1]["state"].items():
        for key, value in entry.items():
            assert torch.equal(torch.as_tensor(after[1]["state"][index][key]),
                               torch.as_tensor(value)), (index, key)


def failing_once(tensor, access, error):
    """Makes ``tensor``'s next acquire with ``access`` raise ``error``."""
    acquire = tensor.acquire

    def acquire_once(tier=zoe.Tier.HOST, wanted=zoe.Access.READ_WRITE):
        if wanted == access:
            del tensor.acquire
            raise error
        return acquire(tier, wanted)

    tensor.acquire = acquire_once


def resumed_equals_uninterrupted(nvme_dir, reference_steps, fail, expected):
    """Trains 3 steps, makes step 3 fail as ``fail(model, pager, optimizer)`` arms, checks that
    the error says ``expected`` and changed nothing, then trains steps 3..reference_steps again
    and compares with torch."""
    engine, model, pager, optimizer = streamed_setup(nvme_dir)
    with engine:
        train_steps(model, optimizer, 3, ROWS)
        before = snapshot(pager, optimizer)
        fail(model, pager, optimizer)
        with pytest.raises(zoe.Error, match=expected):
            train_steps(model, optimizer, 1, ROWS, first=3)
        assert_same_snapshot(before, snapshot(pager, optimizer))
        train_steps(model, optimizer, reference_steps - 3, ROWS, first=3)
        assert_matches(pager.state_dict(), reference_parameters(reference_steps))
        optimizer.close()
        pager.remove()


def test_a_failed_gradient_write_changes_nothing_and_the_run_resumes(nvme_dir):
    def fail(model, pager, optimizer):
        stream = optimizer._groups[0].stream
        store = next(iter(stream._stores.values()))
        failing_once(store.tensor, zoe.Access.WRITE,
                     zoe.NoSpace(zoe.NoSpace.status, "injected: no room to write the gradient"))

    resumed_equals_uninterrupted(nvme_dir, 6, fail, "injected: no room to write the gradient")


def test_a_failed_parameter_read_changes_nothing_and_the_run_resumes(nvme_dir):
    def fail(model, pager, optimizer):
        record = pager._records[id(model.layers[2].weight)]
        failing_once(record.tensor, zoe.Access.READ,
                     zoe.IoError(zoe.IoError.status, "injected: reading the parameter failed"))

    resumed_equals_uninterrupted(nvme_dir, 6, fail, "injected: reading the parameter failed")


def test_a_failed_optimizer_step_gives_the_parameters_back_and_the_run_resumes(nvme_dir):
    """zoe's step of the first window fails after the window's parameters were acquired for it
    to write: they are written back from the (unchanged) master, so nothing changed."""
    def fail(model, pager, optimizer):
        zoe_group = optimizer._groups[0].zoe_group
        step = zoe_group.step

        def failing_step(*args, **kwargs):
            del zoe_group.step
            raise zoe.IoError(zoe.IoError.status, "injected: reading the optimizer state failed")

        zoe_group.step = failing_step
        del step

    resumed_equals_uninterrupted(nvme_dir, 6, fail, "injected: reading the optimizer state")


def test_a_corrupted_gradient_store_is_an_error_never_a_wrong_step(nvme_dir):
    """Every store written down to NVMe, then every byte of the tensors' swap files flipped: the step
    reports the checksum failure and changes nothing (the first window's read failed before
    any window stepped)."""
    engine, model, pager, optimizer = streamed_setup(nvme_dir)
    with engine:
        train_steps(model, optimizer, 2, ROWS)
        before = snapshot(pager, optimizer)
        loss_of(model, 2, slice(None)).backward()
        stream = optimizer._groups[0].stream
        for store in stream._stores.values():
            store.tensor.evict()
        engine.flush()
        swap_files = glob.glob(os.path.join(nvme_dir, "**", "zoe-swap-*.swap"), recursive=True)
        assert swap_files
        for path in swap_files:
            with open(path, "r+b") as file:
                data = bytearray(file.read())
                file.seek(0)
                file.write(bytes(b ^ 0xFF for b in data))
        with pytest.raises(zoe.Corruption):
            optimizer.step()
        assert stream.broken is None  # nothing was stepped
        assert_same_snapshot(({}, before[1]), ({}, optimizer.state_dict()))
        optimizer.close()


def test_a_step_failing_after_a_window_refuses_until_a_checkpoint_is_loaded(nvme_dir):
    engine, model, pager, optimizer = streamed_setup(nvme_dir)
    checkpoint = os.path.join(nvme_dir, "checkpoint")
    with engine:
        train_steps(model, optimizer, 3, ROWS)
        optimizer.save_checkpoint(checkpoint)
        for part in ROWS:
            loss_of(model, 3, part).backward()
        stream = optimizer._groups[0].stream
        last = list(stream._stores.values())[-1]
        failing_once(last.tensor, zoe.Access.READ,
                     zoe.IoError(zoe.IoError.status, "injected: reading the gradient failed"))
        with pytest.raises(zoe.IoError, match="reading the gradient failed"):
            optimizer.step()
        assert stream.broken is not None
        loss_of(model, 3, slice(None)).backward()
        with pytest.raises(zoe.FailedPrecondition, match="partly stepped.*load a checkpoint"):
            optimizer.step()
        optimizer.load_checkpoint(checkpoint)
        train_steps(model, optimizer, 3, ROWS, first=3)
        assert_matches(pager.state_dict(), reference_parameters(6))
        optimizer.close()
        pager.remove()
