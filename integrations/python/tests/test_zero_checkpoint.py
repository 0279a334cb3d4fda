"""Sharded checkpoints on gloo ranks of this machine: every rank SIGKILLed during a save (at
three points of it) leaves the previous checkpoint -- or, once the manifest was replaced, the new
one -- loading on every rank, never a mix of two saves, and resuming gives an uninterrupted run's
parameters bit for bit; a save or a load that fails on one rank (at any step of it) raises zoe's
error naming that rank on every rank, well within the process group's timeout, leaves the
previous checkpoint and every rank's optimizer as they were, and the ranks save, load and train
on; a checkpoint consolidated without the ranks (the function and
``python3 -m zoe.consolidate``) equals the live ranks' state_dict() and, loaded by 3 ranks,
continues as one process does, for AdamW, Lion and Adagrad, moments in fp32, bf16 and int8 (a
sharded optimizer of another kind refuses the checkpoint, naming both); stage 3 saves and
restores its parameter shards."""

import datetime
import errno
import functools
import glob
import json
import os
import subprocess
import sys
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import zoe
import zoe.torch
from zoe.torch import checkpoint
from test_torch_zero import Net, make_optimizer, train
import test_zero3

SAVE_A_STEP = 5  # checkpoint A: after steps 0..4
SAVE_B_STEP = 8  # checkpoint B, killed: after steps 5..7
TOTAL_STEPS = 10
PAUSE_SECONDS = 300  # a paused rank waits to be killed
JOIN_SECONDS = 120
GROUP_TIMEOUT_S = 60  # the process group's; a failure agreed between the ranks takes < 1/3 of it

# Where the ranks are killed in save B, and which ranks announce that they reached it:
# - one_shard_saved: rank 1 wrote its whole shard of B, rank 0 none of its own;
# - shards_saved: every shard of B is written, rank 0 is about to replace the manifest;
# - manifest_replaced: the manifest names B, the ranks are about to remove A.
KILL_POINTS = {"one_shard_saved": (0, 1), "shards_saved": (0,), "manifest_replaced": (0, 1)}


def init(rank, world, out_dir):
    dist.init_process_group("gloo", init_method="file://" + os.path.join(out_dir, "rendezvous"),
                            rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))


def sharded(out_dir, name, zero_stage=2):
    model = Net()
    optimizer = make_optimizer("AdamW", model.parameters(),
                               os.path.join(out_dir, name + "-nvme-{rank}"),
                               process_group=dist.group.WORLD, zero_stage=zero_stage,
                               bucket_elements=100)
    return model, optimizer


def params_of(model):
    return [param.detach().clone() for param in model.parameters()]


def guarded(function):
    """Runs a rank's body; a traceback goes to crash<rank>.txt for the parent to report."""

    @functools.wraps(function)
    def run(rank, world, out_dir, *args):
        try:
            init(rank, world, out_dir)
            function(rank, world, out_dir, *args)
        except BaseException:
            with open(os.path.join(out_dir, f"crash{rank}.txt"), "w") as file:
                file.write(traceback.format_exc())
            raise

    return run


def start(body, world, out_dir, *args):
    """``body`` on ``world`` fresh ranks (forkserver: torch is imported once); the context."""
    for path in glob.glob(os.path.join(out_dir, "rendezvous")):
        os.remove(path)
    return mp.start_processes(body, args=(world, out_dir, *args), nprocs=world, join=False,
                              start_method="forkserver")


def join(context, out_dir):
    deadline = time.monotonic() + JOIN_SECONDS
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"ranks still running after {JOIN_SECONDS} s: a hang")
    crashes = sorted(glob.glob(os.path.join(out_dir, "crash*.txt")))
    assert not crashes, open(crashes[0]).read()


# --- killed during a save ------------------------------------------------------------------


def pause(out_dir, rank):
    with open(os.path.join(out_dir, f"paused{rank}"), "w"):
        pass
    time.sleep(PAUSE_SECONDS)


def wrap(name, before=None, after=None):
    """Replaces zoe.torch.checkpoint.<name> in this rank with a version that calls ``before`` first
    and ``after`` (given its arguments) once it returned."""
    original = getattr(checkpoint, name)

    def wrapped(*args, **kwargs):
        if before is not None:
            before()
        result = original(*args, **kwargs)
        if after is not None:
            after(*args)
        return result

    setattr(checkpoint, name, wrapped)
    return lambda: setattr(checkpoint, name, original)  # undoes the wrap


def pause_at(point, rank, out_dir):
    """Makes this rank stop (announced, waiting to be killed) at ``point`` of its next save."""
    stop = lambda: pause(out_dir, rank)  # noqa: E731
    if point == "one_shard_saved":
        # rank 0 before it writes anything of B; rank 1 after its whole shard of B
        if rank == 0:
            wrap("_fresh_directory", stop)
        else:
            wrap("_write_shard", after=lambda *_: stop())
    elif point == "shards_saved" and rank == 0:
        wrap("_publish_manifest", stop)  # rank 1 waits in the agreement after it
    elif point == "manifest_replaced":
        wrap("_remove_old_saves", stop)


@guarded
def killed_run(rank, world, out_dir, point):
    model, optimizer = sharded(out_dir, "killed")
    directory = os.path.join(out_dir, "checkpoint")
    train(optimizer, model, rank, world, steps=SAVE_A_STEP)
    torch.save(params_of(model), os.path.join(out_dir, f"params-A-rank{rank}.pt"))
    optimizer.save_checkpoint(directory)
    train(optimizer, model, rank, world, steps=SAVE_B_STEP - SAVE_A_STEP, first=SAVE_A_STEP)
    torch.save(params_of(model), os.path.join(out_dir, f"params-B-rank{rank}.pt"))
    pause_at(point, rank, out_dir)
    optimizer.save_checkpoint(directory)
    with open(os.path.join(out_dir, f"finished{rank}"), "w"):
        pass  # the parent fails the test: the save was to be killed


@guarded
def resumed_run(rank, world, out_dir, first_step):
    """Loads the checkpoint, resumes at ``first_step`` up to TOTAL_STEPS, runs the same steps
    uninterrupted beside it, then saves again (which removes what the killed save left)."""
    directory = os.path.join(out_dir, "checkpoint")
    model, optimizer = sharded(out_dir, "resumed")
    optimizer.load_checkpoint(directory)
    loaded = params_of(model)
    train(optimizer, model, rank, world, steps=TOTAL_STEPS - first_step, first=first_step)
    straight, straight_optimizer = sharded(out_dir, "straight")
    train(straight_optimizer, straight, rank, world, steps=TOTAL_STEPS)
    optimizer.save_checkpoint(directory)
    torch.save({"loaded": loaded, "resumed": params_of(model), "straight": params_of(straight),
                "saves": sorted(os.listdir(os.path.join(directory, f"rank-{rank}")))},
               os.path.join(out_dir, f"resumed-rank{rank}.pt"))
    for each in (optimizer, straight_optimizer):
        each.close()


def kill_when_paused(context, out_dir, ranks):
    """SIGKILLs every rank once ``ranks`` announced their pause (each is mid-save)."""
    deadline = time.monotonic() + JOIN_SECONDS
    while not all(os.path.exists(os.path.join(out_dir, f"paused{r}")) for r in ranks):
        crashes = glob.glob(os.path.join(out_dir, "crash*.txt"))
        assert not crashes, open(crashes[0]).read()
        assert time.monotonic() < deadline, "the ranks never reached the point of the kill"
        time.sleep(0.05)
    for process in context.processes:
        process.kill()
    for process in context.processes:
        process.join()
    assert not glob.glob(os.path.join(out_dir, "finished*")), "a save ran to its end"


@pytest.mark.parametrize("point", sorted(KILL_POINTS))
def test_ranks_killed_during_a_save_load_one_checkpoint_and_resume(point, nvme_dir):
    world = 2
    kill_when_paused(start(killed_run, world, nvme_dir, point), nvme_dir, KILL_POINTS[point])
    published = point == "manifest_replaced"
    name, first = ("B", SAVE_B_STEP) if published else ("A", SAVE_A_STEP)
    with open(os.path.join(nvme_dir, "checkpoint", checkpoint.MANIFEST)) as file:
        assert json.load(file)["version"] == (2 if published else 1)
    join(start(resumed_run, world, nvme_dir, first), nvme_dir)
    want = torch.load(os.path.join(nvme_dir, f"params-{name}-rank0.pt"))
    for rank in range(world):
        got = torch.load(os.path.join(nvme_dir, f"resumed-rank{rank}.pt"))
        for index, (a, b) in enumerate(zip(got["loaded"], want)):
            assert torch.equal(a, b), f"rank {rank} parameter {index}: not checkpoint {name}"
        for index, (a, b) in enumerate(zip(got["resumed"], got["straight"])):
            assert torch.equal(a, b), f"rank {rank} parameter {index}: resumed != uninterrupted"
        # the save after the resume is the only one left: the killed save's shards are gone (it
        # is numbered past them: a save never reuses the number of one on disk)
        assert got["saves"] == ["save-000003"], got["saves"]


# --- a save or a load that fails on one rank --------------------------------------------------


def manifest_taken_by_a_directory(directory):
    """Rank 0 cannot publish the manifest: its path is a directory (the live one moved aside for
    the save, put back by the returned undo)."""
    path = os.path.join(directory, checkpoint.MANIFEST)
    os.replace(path, path + ".aside")
    os.mkdir(path)

    def undo():
        os.rmdir(path)
        os.replace(path + ".aside", path)

    return undo


def no_space_for_the_shard(directory):
    """The rank's shard folder cannot be made: no space (injected)."""
    def refuse():
        raise OSError(errno.ENOSPC, "No space left on device (injected)")

    return wrap("_fresh_directory", refuse)


def engine_cannot_name_its_save(directory):
    """The engine writes the rank's whole shard, then cannot publish it: the path of its LATEST
    in the fresh shard folder is taken by a directory."""
    return wrap("_fresh_directory", after=lambda path: os.mkdir(os.path.join(path, "LATEST")))


# fault: (the failing rank, what fails, the class it raises there, how the fault is arranged)
SAVE_FAULTS = {
    "manifest_taken_by_a_directory": (0, "publishing the manifest", "IoError",
                                      manifest_taken_by_a_directory),
    "no_space_for_the_shard": (1, "saving the shards", "NoSpace", no_space_for_the_shard),
    "engine_cannot_name_its_save": (1, "saving the shards", "IoError",
                                    engine_cannot_name_its_save),
}


def timed_outcome(call):
    """(what ``call()`` raised, as "Class: message", or "no error"; its seconds)."""
    began = time.monotonic()
    try:
        call()
        outcome = "no error"
    except Exception as error:  # the outcome under test
        outcome = f"{type(error).__name__}: {error}"
    return outcome, time.monotonic() - began


def manifest_version(directory):
    with open(os.path.join(directory, checkpoint.MANIFEST)) as file:
        return json.load(file)["version"]


@guarded
def failed_save_run(rank, world, out_dir, fault):
    """Checkpoint A; 3 steps; save B fails on one rank (``fault``); every rank loads A again,
    takes the 3 steps again, saves B (which succeeds) and loads it."""
    model, optimizer = sharded(out_dir, "failed")
    directory = os.path.join(out_dir, "checkpoint")
    train(optimizer, model, rank, world, steps=SAVE_A_STEP)
    params_a = params_of(model)
    optimizer.save_checkpoint(directory)
    train(optimizer, model, rank, world, steps=SAVE_B_STEP - SAVE_A_STEP, first=SAVE_A_STEP)
    params_b = params_of(model)
    failing, _, _, arrange = SAVE_FAULTS[fault]
    undo = arrange(directory) if rank == failing else (lambda: None)
    outcome, seconds = timed_outcome(lambda: optimizer.save_checkpoint(directory))
    undo()
    dist.barrier()  # the fault is gone before any rank reads the checkpoint
    version_after_failure = manifest_version(directory)
    optimizer.load_checkpoint(directory)
    loaded_a = params_of(model)
    train(optimizer, model, rank, world, steps=SAVE_B_STEP - SAVE_A_STEP, first=SAVE_A_STEP)
    optimizer.save_checkpoint(directory)
    optimizer.load_checkpoint(directory)
    torch.save({"outcome": outcome, "seconds": seconds,
                "version_after_failure": version_after_failure,
                "loaded_a": all(map(torch.equal, loaded_a, params_a)),
                "loaded_b": all(map(torch.equal, params_of(model), params_b)),
                "version": manifest_version(directory),
                "saves": sorted(os.listdir(os.path.join(directory, f"rank-{rank}")))},
               os.path.join(out_dir, f"failed-rank{rank}.pt"))
    optimizer.close()


def assert_agreed(outcomes, failing, what, error_class):
    """Every rank raised within a third of the group's timeout: the failing rank zoe's
    ``error_class`` naming itself and ``what`` failed, the others zoe.Aborted naming it."""
    for rank, (outcome, seconds) in enumerate(outcomes):
        assert seconds < GROUP_TIMEOUT_S / 3, (rank, seconds, outcome)
        if rank == failing:
            assert outcome.startswith(f"{error_class}: {what} "), outcome
            assert f" failed on rank {failing}: " in outcome, outcome
        else:
            assert outcome.startswith(f"Aborted: {what} "), outcome
            assert f" failed on rank {failing} (rank {failing}: zoe.{error_class}: " in outcome, \
                outcome


@pytest.mark.parametrize("fault", sorted(SAVE_FAULTS))
def test_a_save_that_fails_on_one_rank_raises_everywhere_and_keeps_the_checkpoint(fault,
                                                                                   nvme_dir):
    join(start(failed_save_run, 2, nvme_dir, fault), nvme_dir)
    got = [torch.load(os.path.join(nvme_dir, f"failed-rank{rank}.pt")) for rank in range(2)]
    failing, what, error_class, _ = SAVE_FAULTS[fault]
    assert_agreed([(each["outcome"], each["seconds"]) for each in got], failing, what,
                  error_class)
    for rank, each in enumerate(got):
        assert each["version_after_failure"] == 1  # the manifest still names A ...
        assert each["loaded_a"], rank  # ... which loads
        assert each["loaded_b"], rank  # the ranks went on: B saved and loaded again
        # the one save left is the one the manifest names (the failed one's shards are gone)
        assert each["saves"] == [f"save-{each['version']:06d}"], each["saves"]


def corrupt(path):
    """Overwrites 64 bytes in the middle of the file."""
    with open(path, "r+b") as file:
        file.seek(os.path.getsize(path) // 2)
        file.write(b"\x5a" * 64)


# fault of rank 1's shard state file: (how, the class rank 1 raises)
LOAD_FAULTS = {"corrupted": (corrupt, "Corruption"), "removed": (os.remove, "Corruption")}


@guarded
def failed_load_run(rank, world, out_dir, fault):
    """Checkpoint A after 5 steps; 3 more steps; a load of A that fails on rank 1 (its shard's
    state file ``fault``); the state before and after it; one more step; 9 steps of an optimizer
    that never tried the load."""
    model, optimizer = sharded(out_dir, "failed")
    directory = os.path.join(out_dir, "checkpoint")
    train(optimizer, model, rank, world, steps=SAVE_A_STEP)
    optimizer.save_checkpoint(directory)
    train(optimizer, model, rank, world, steps=SAVE_B_STEP - SAVE_A_STEP, first=SAVE_A_STEP)
    before, params_before = optimizer.state_dict(), params_of(model)
    if rank == 1:
        state_files = glob.glob(os.path.join(directory, "rank-1", "save-*", "v*", "*.state"))
        assert state_files, os.listdir(os.path.join(directory, "rank-1"))
        LOAD_FAULTS[fault][0](state_files[0])
    outcome, seconds = timed_outcome(lambda: optimizer.load_checkpoint(directory))
    after, params_after = optimizer.state_dict(), params_of(model)
    train(optimizer, model, rank, world, steps=1, first=SAVE_B_STEP)
    straight, straight_optimizer = sharded(out_dir, "straight")
    train(straight_optimizer, straight, rank, world, steps=SAVE_B_STEP + 1)
    torch.save({"outcome": outcome, "seconds": seconds, "before": before, "after": after,
                "params_unchanged": all(map(torch.equal, params_after, params_before)),
                "stepped": params_of(model), "straight": params_of(straight),
                "left": sorted(os.listdir(os.path.join(directory, f"rank-{rank}")))},
               os.path.join(out_dir, f"failed-load-rank{rank}.pt"))
    for each in (optimizer, straight_optimizer):
        each.close()


@pytest.mark.parametrize("fault", sorted(LOAD_FAULTS))
def test_a_load_that_fails_on_one_rank_raises_everywhere_and_changes_nothing(fault, nvme_dir):
    join(start(failed_load_run, 2, nvme_dir, fault), nvme_dir)
    got = [torch.load(os.path.join(nvme_dir, f"failed-load-rank{rank}.pt")) for rank in range(2)]
    assert_agreed([(each["outcome"], each["seconds"]) for each in got], 1, "loading the shards",
                  LOAD_FAULTS[fault][1])
    for rank, each in enumerate(got):
        # rank 0 loaded its shard before rank 1 failed: it went back to its state before
        assert_same_state(each["after"], each["before"])
        assert each["params_unchanged"], rank
        for index, (a, b) in enumerate(zip(each["stepped"], each["straight"])):
            assert torch.equal(a, b), f"rank {rank} parameter {index}: != a run without the load"
        assert each["left"] == ["save-000001"], each["left"]  # no scratch save left behind


# --- consolidation without the ranks, then another world size ---------------------------------


@guarded
def two_rank_run(rank, world, out_dir):
    """10 steps; a sharded checkpoint; the live consolidated state_dict() and the parameters
    (rank 0 saves them)."""
    model, optimizer = sharded(out_dir, "two")
    train(optimizer, model, rank, world, steps=10)
    optimizer.save_checkpoint(os.path.join(out_dir, "checkpoint"))
    live = optimizer.state_dict()
    if rank == 0:
        torch.save({"state_dict": live, "params": params_of(model)},
                   os.path.join(out_dir, "live.pt"))
    optimizer.close()


@guarded
def three_rank_run(rank, world, out_dir):
    """The 2-rank parameters and the consolidated file loaded on 3 ranks; steps 10..19."""
    model, optimizer = sharded(out_dir, "three", zero_stage=1)
    with torch.no_grad():
        for param, value in zip(model.parameters(), torch.load(os.path.join(out_dir,
                                                                            "live.pt"))["params"]):
            param.copy_(value)
    optimizer.load_state_dict(torch.load(os.path.join(out_dir, "consolidated.pt")))
    train(optimizer, model, rank, world, steps=10, first=10)
    torch.save(params_of(model), os.path.join(out_dir, f"three-rank{rank}.pt"))
    optimizer.close()


def one_process_parameters(directory):
    """20 steps of the unsharded optimizer in this process."""
    os.makedirs(directory)
    model = Net()
    optimizer = make_optimizer("AdamW", model.parameters(), directory)
    train(optimizer, model, 0, 1, steps=20)
    optimizer.close()
    return params_of(model)


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "zoe.consolidate", *args], capture_output=True,
                          text=True, env=dict(os.environ), timeout=JOIN_SECONDS)


def assert_same_state(got, want, moments=("exp_avg", "exp_avg_sq")):
    assert got["param_groups"] == want["param_groups"]
    assert sorted(got["state"]) == sorted(want["state"])
    for index, entry in want["state"].items():
        assert sorted(got["state"][index]) == sorted(entry) == sorted(("step",) + moments)
        for key, value in entry.items():
            assert torch.equal(got["state"][index][key], value), f"parameter {index} {key}"


def test_consolidated_checkpoint_equals_live_state_and_moves_to_three_ranks(nvme_dir):
    join(start(two_rank_run, 2, nvme_dir), nvme_dir)
    directory = os.path.join(nvme_dir, "checkpoint")
    out = os.path.join(nvme_dir, "consolidated.pt")
    scratch = os.path.join(nvme_dir, "scratch")
    os.makedirs(scratch)
    result = run_cli("--scratch-dir", scratch, directory, out)
    assert result.returncode == 0, result.stderr
    assert "the state of 5 parameters" in result.stdout, result.stdout
    live = torch.load(os.path.join(nvme_dir, "live.pt"))["state_dict"]
    assert_same_state(torch.load(out), live)
    assert_same_state(zoe.torch.consolidated_state_dict(directory), live)

    join(start(three_rank_run, 3, nvme_dir), nvme_dir)
    want = one_process_parameters(os.path.join(nvme_dir, "one"))
    for rank in range(3):
        got = torch.load(os.path.join(nvme_dir, f"three-rank{rank}.pt"))
        for index, (a, b) in enumerate(zip(got, want)):
            torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-6,
                                       msg=f"2 -> 3 ranks: rank {rank} parameter {index}")

    # A shard replaced after the manifest was written is refused, naming the rank.
    with open(os.path.join(directory, "rank-1", "save-000001", "LATEST"), "w") as file:
        file.write("v000099\n")
    with pytest.raises(zoe.Corruption, match="rank 1's shard .* holds v000099"):
        zoe.torch.consolidated_state_dict(directory)
    missing = run_cli(os.path.join(nvme_dir, "none"), out)
    assert missing.returncode == 1
    assert "holds no sharded zoe checkpoint" in missing.stderr, missing.stderr


@guarded
def consolidation_run(rank, world, out_dir, kind, moment_dtype):
    """4 steps of a zoe.torch ``kind`` with moments in ``moment_dtype``; a sharded checkpoint;
    rank 0 saves the live state_dict() (moments exported as fp32, as torch keeps them)."""
    name = kind + "-" + moment_dtype
    model = Net()
    optimizer = make_optimizer(kind, model.parameters(),
                               os.path.join(out_dir, name + "-nvme-{rank}"),
                               process_group=dist.group.WORLD, zero_stage=2, bucket_elements=100,
                               moment_dtype=moment_dtype)
    train(optimizer, model, rank, world, steps=4)
    optimizer.save_checkpoint(os.path.join(out_dir, name))
    live = optimizer.state_dict()
    if rank == 0:
        torch.save(live, os.path.join(out_dir, name + "-live.pt"))
    optimizer.close()
    other = make_optimizer("Adam", model.parameters(),  # a kind no parametrized case is
                           os.path.join(out_dir, name + "-other-{rank}"),
                           process_group=dist.group.WORLD, zero_stage=2, bucket_elements=100)
    try:
        other.load_checkpoint(os.path.join(out_dir, name))
        refused = "no error"
    except zoe.Error as error:
        refused = str(error)
    other.close()
    torch.save(refused, os.path.join(out_dir, f"{name}-refused-rank{rank}.pt"))


@pytest.mark.parametrize("kind,moment_dtype,moments", [
    ("AdamW", "bf16", ("exp_avg", "exp_avg_sq")), ("AdamW", "int8", ("exp_avg", "exp_avg_sq")),
    ("Lion", "fp32", ("exp_avg",)), ("Adagrad", "int8", ("sum",))])
def test_consolidated_moments_of_every_kind_and_dtype_equal_the_live_state(kind, moment_dtype,
                                                                          moments, nvme_dir):
    """Moments held in fp32, bf16 or block-quantized int8, AdamW's two or Lion's and Adagrad's
    one, consolidate to the fp32 values the live ranks export, bit for bit, in torch's names."""
    join(start(consolidation_run, 2, nvme_dir, kind, moment_dtype), nvme_dir)
    name = kind + "-" + moment_dtype
    live = torch.load(os.path.join(nvme_dir, name + "-live.pt"))
    got = zoe.torch.consolidated_state_dict(os.path.join(nvme_dir, name))
    assert_same_state(got, live, moments)
    assert any(entry[moments[0]].abs().sum() > 0 for entry in got["state"].values())
    for rank in range(2):  # a sharded optimizer of another kind refuses the checkpoint
        refused = torch.load(os.path.join(nvme_dir, f"{name}-refused-rank{rank}.pt"))
        assert f"is of zoe.torch.{kind}; this optimizer is zoe.torch.Adam" in refused, refused
    manifest_path = os.path.join(nvme_dir, name, checkpoint.MANIFEST)
    with open(manifest_path) as file:
        manifest = json.load(file)
    with open(manifest_path, "w") as file:
        json.dump(dict(manifest, optimizer="Sgd"), file)
    with pytest.raises(zoe.Corruption, match="the manifest's optimizer is 'Sgd', which is no "
                                             "optimizer zoe steps"):
        zoe.torch.consolidated_state_dict(os.path.join(nvme_dir, name))


# --- stage 3 -------------------------------------------------------------------------------


def stage3_run(rank, world, out_dir, name, steps, first=0, load=None, save=None, kind="AdamW"):
    """``steps`` stage 3 steps of zoe.torch ``kind`` from ``first`` (after loading ``load``; then
    saving to ``save``); the gathered parameters."""
    engine, _ = test_zero3.engine_for(os.path.join(out_dir, name), rank)
    torch.manual_seed(0)
    model = test_zero3.Model()
    pager = zoe.torch.offload_parameters(model, engine, process_group=dist.group.WORLD)
    optimizer = getattr(zoe.torch, kind)(pager.shard_parameters(), lr=test_zero3.LR,
                                         weight_decay=0.01, engine=engine,
                                         max_grad_norm=test_zero3.MAX_NORM)
    if load is not None:
        pager.load_checkpoint(load, optimizer)
    rows = slice(test_zero3.BATCH * rank // world, test_zero3.BATCH * (rank + 1) // world)
    for step in range(first, first + steps):
        optimizer.zero_grad(set_to_none=True)
        test_zero3.loss_of(model, step, rows).backward()
        optimizer.step()
    if save is not None:
        pager.save_checkpoint(save, optimizer)
    state = pager.state_dict()
    pager.remove()
    optimizer.close()
    engine.close()
    return state


@guarded
def stage3_checkpoint_run(rank, world, out_dir):
    """6 steps straight; 3 steps and a checkpoint; a fresh model that loads it (its gathered
    parameters right after the load) and takes the 3 others; a refused checkpoint."""
    directory = os.path.join(out_dir, "checkpoint")
    straight = stage3_run(rank, world, out_dir, "straight", 6)
    saved = stage3_run(rank, world, out_dir, "first", 3, save=directory)
    loaded = stage3_run(rank, world, out_dir, "loaded", 0, load=directory)
    resumed = stage3_run(rank, world, out_dir, "resumed", 3, first=3, load=directory)
    other = os.path.join(out_dir, "stage2")
    os.makedirs(other, exist_ok=True)
    with open(os.path.join(other, checkpoint.MANIFEST), "w") as file:
        json.dump({"world_size": world, "zero_stage": 2, "groups": []}, file)
    try:
        stage3_run(rank, world, out_dir, "refused", 0, load=other)
        refused = "no error"
    except zoe.FailedPrecondition as error:
        refused = str(error)
    try:
        stage3_run(rank, world, out_dir, "other-kind", 0, load=directory, kind="Lion")
        other_kind = "no error"
    except zoe.InvalidArgument as error:
        other_kind = str(error)
    torch.save({"straight": straight, "saved": saved, "loaded": loaded, "resumed": resumed,
                "refused": refused, "other_kind": other_kind,
                "files": sorted(os.listdir(directory))},
               os.path.join(out_dir, f"stage3-rank{rank}.pt"))


def test_stage3_checkpoint_restores_parameter_shards_and_resumes(nvme_dir):
    join(start(stage3_checkpoint_run, 2, nvme_dir), nvme_dir)
    for rank in range(2):
        got = torch.load(os.path.join(nvme_dir, f"stage3-rank{rank}.pt"))
        assert got["files"] == ["rank-0", "rank-1", checkpoint.MANIFEST], got["files"]
        assert sorted(got["loaded"]) == sorted(got["saved"])
        for key, value in got["saved"].items():
            assert torch.equal(got["loaded"][key], value), f"rank {rank} {key}: not loaded"
            assert not torch.equal(got["straight"][key], value), f"{key}: no step after save"
        for key, value in got["straight"].items():
            assert torch.equal(got["resumed"][key], value), f"rank {rank} {key}: resumed"
        assert "is of stage 2 on 2 ranks" in got["refused"], got["refused"]
        assert "is of zoe.torch.AdamW; this optimizer is zoe.torch.Lion" in got["other_kind"], \
            got["other_kind"]

    # Consolidated without the ranks: the parameters the ranks gathered after the save, bit for
    # bit, and an optimizer state that one process with torch's AdamW continues from (steps 3..5
    # on the whole batch) to the 2-rank run's parameters after 6 steps.
    consolidated = zoe.torch.consolidated_state_dict(os.path.join(nvme_dir, "checkpoint"))
    saved = torch.load(os.path.join(nvme_dir, "stage3-rank0.pt"))["saved"]
    assert sorted(consolidated["model"]) == sorted(saved)
    for key, value in saved.items():
        assert torch.equal(consolidated["model"][key], value), f"{key}: consolidated"
    model = test_zero3.Model()
    model.load_state_dict(consolidated["model"])
    names = [name for name, _ in model.named_parameters()]
    steps = {names[index]: entry["step"].item()
             for index, entry in consolidated["optimizer"]["state"].items()}
    # even_only runs on steps 0 and 2 of 0..2: its parameters' own step count is 2
    assert steps == {name: 2.0 if name.startswith("even_only") else 3.0 for name in names}
    optimizer = torch.optim.AdamW(model.parameters(), lr=test_zero3.LR, weight_decay=0.01)
    optimizer.load_state_dict(consolidated["optimizer"])
    for step in range(3, 6):
        optimizer.zero_grad(set_to_none=True)
        test_zero3.loss_of(model, step, slice(None)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), test_zero3.MAX_NORM)
        optimizer.step()
    straight = torch.load(os.path.join(nvme_dir, "stage3-rank0.pt"))["straight"]
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.detach(), straight[name], rtol=2e-5, atol=2e-6,
                                   msg=f"{name}: consolidated, then 3 steps in one process")

    # A manifest written before it listed each param group's parameters (one group) gives the
    # same. One whose shard layout does not match what a rank's optimizer holds, one without the
    # optimizer's param group, and one listing the parameters of another number of groups are
    # refused with what is allowed.
    path = os.path.join(nvme_dir, "checkpoint", checkpoint.MANIFEST)
    with open(path) as file:
        manifest = json.load(file)
    assert manifest["group_parameters"] == [list(range(len(manifest["parameters"])))]
    with open(path, "w") as file:
        json.dump({k: v for k, v in manifest.items() if k != "group_parameters"}, file)
    older = zoe.torch.consolidated_state_dict(os.path.join(nvme_dir, "checkpoint"))
    assert older["optimizer"]["param_groups"] == consolidated["optimizer"]["param_groups"]
    for key, value in consolidated["model"].items():
        assert torch.equal(older["model"][key], value), key
    moved = json.loads(json.dumps(manifest))
    moved["parameters"][0]["counts"] = list(reversed(moved["parameters"][0]["counts"]))
    moved["parameters"][0]["counts"][0] += 1
    for changed, message in ((moved, "rank 0's optimizer .* holds segments of"),
                             ({k: v for k, v in manifest.items() if k != "param_groups"},
                              "names 0 param groups and lists the parameters of 1; allowed"),
                             (dict(manifest, group_parameters=[[0], [1]]),
                              "names 1 param groups and lists the parameters of 2")):
        with open(path, "w") as file:
            json.dump(changed, file)
        with pytest.raises(zoe.FailedPrecondition, match=message):
            zoe.torch.consolidated_state_dict(os.path.join(nvme_dir, "checkpoint"))
