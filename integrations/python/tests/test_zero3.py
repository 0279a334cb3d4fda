"""ZeRO stage 3 (offload_parameters with a process group) on 1, 2 and 3 gloo ranks started on
this machine: 20 steps equal one unsharded process (uneven shards, clipping agreed across ranks,
a skipped non-finite step, a module unused on odd steps), bucketed gradient reductions give the
parameters of one reduction per parameter with fewer collectives, the bytes each rank holds fall
with N, the trace prefetches gathers, and a rank whose swap file is corrupted makes every rank
raise, naming it, well within the process group's timeout, with the ranks still paired;
materialized() gathers the full values and writes each rank's slice back, agreed across the
ranks, and the misuses of a sharded model (state_dict of placeholders, a stage 1/2 optimizer
over it) are refused naming the fix."""

import datetime
import math
import multiprocessing
import os
import shutil
import tempfile
import time
import traceback
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import zoe
import zoe.torch
from conftest import small_config
from zoe.torch.distributed import shard_counts

STEPS = 20
BATCH = 6  # rows per step, split evenly over 1, 2 or 3 ranks
LR = 1e-3
MAX_NORM = 0.5
NONFINITE_STEP = 7  # rank 0's loss becomes inf: every rank must skip this step


class Model(torch.nn.Module):
    """Sizes that shard unevenly over 2 and 3 ranks, a 1-element bias (empty shards), a root
    parameter, a weight tied to the embedding and a module used on even steps only."""

    def __init__(self, vocab=11, width=10, layers=4):
        super().__init__()
        self.tokens = torch.nn.Embedding(vocab, width)
        self.scale = torch.nn.Parameter(torch.ones(width) + 0.1 * torch.randn(width))
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(layers))
        self.even_only = torch.nn.Linear(width, width)
        self.gate = torch.nn.Linear(width, 1)
        self.head = torch.nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tokens.weight

    def forward(self, idx, step):
        x = self.tokens(idx).mean(1) * self.scale
        for layer in self.layers:
            x = torch.tanh(layer(x))
        if step % 2 == 0:
            x = x + self.even_only(x)
        return self.head(x * torch.sigmoid(self.gate(x)))


def batch(step):
    generator = torch.Generator().manual_seed(1000 + step)
    idx = torch.randint(0, 11, (BATCH, 5), generator=generator)
    return idx, torch.randint(0, 11, (BATCH,), generator=generator)


def loss_of(model, step, rows):
    idx, target = batch(step)
    logits = model(idx[rows], step)
    return torch.nn.functional.cross_entropy(logits, target[rows])


def reference_parameters():
    """One process, no sharding: torch's AdamW, torch's clipping, the same skipped step."""
    torch.manual_seed(0)
    model = Model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        loss_of(model, step, slice(None)).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        if step != NONFINITE_STEP and math.isfinite(norm):
            optimizer.step()
    return {name: p.detach().clone() for name, p in model.state_dict().items()}


def engine_for(directory, rank, **top_level):
    """Rank's engine: optimizer state and parameter shards on NVMe under its own paths (the
    tensors' swap space is striped over both); ``top_level`` keys added to its configuration."""
    paths = [os.path.join(directory, f"{part}{rank}") for part in ("optim", "param")]
    for path in paths:
        os.makedirs(path, exist_ok=True)
    config = small_config(paths[0], offload="nvme", chunk_size="4K", tensor_host_budget="64K")
    config["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": paths[1]}
    config.update(top_level)
    return zoe.Engine(config), paths


def init(rank, world_size, directory, timeout_s=20):
    dist.init_process_group(
        "gloo", init_method="file://" + os.path.join(directory, "rendezvous"), rank=rank,
        world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s),
    )


def train(rank, world_size, directory, options):
    """One rank of the sharded run (``options``: offload_parameters' stage 3 arguments, such
    as bucket_elements); rank 0 saves the full parameters and every rank its statistics."""
    init(rank, world_size, directory)
    engine, _ = engine_for(directory, rank)
    torch.manual_seed(0)
    model = Model()
    pager = zoe.torch.offload_parameters(model, engine, process_group=dist.group.WORLD,
                                         **options)
    optimizer = zoe.torch.AdamW(pager.shard_parameters(), lr=LR, weight_decay=0.01,
                                engine=engine, max_grad_norm=MAX_NORM)
    rows = slice(BATCH * rank // world_size, BATCH * (rank + 1) // world_size)
    skipped = 0
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        loss = loss_of(model, step, rows)
        if step == NONFINITE_STEP and rank == 0:
            loss = loss * float("inf")
        loss.backward()
        assert all(shard.grad is None for shard in pager.shard_parameters())  # streamed
        optimizer.step()  # clips by the global norm, skips a non-finite step on every rank
        skipped += optimizer.last_step[0].skipped
    gathered_at_end = pager.gathered_bytes  # nothing left gathered between iterations
    state = pager.state_dict()
    stats = pager.stats()
    stats.pop("engine")
    stats["skipped"] = skipped
    stats["gathered_bytes_at_end"] = gathered_at_end
    if rank == 0:
        torch.save(state, os.path.join(directory, "state.pt"))
    torch.save(stats, os.path.join(directory, f"stats{rank}.pt"))
    dist.destroy_process_group()
    engine.close()


def run_ranks(function, world_size, directory, *args):
    """Runs function(rank, world_size, directory, *args) in world_size fresh processes. They
    start from a fork server that imported torch and zoe once (multiprocessing's forkserver: a
    new process, not a fork of this one) rather than each importing torch as spawn's do, which
    on 2 shared cores takes seconds per process."""
    mp.start_processes(function, args=(world_size, directory, *args), nprocs=world_size,
                       join=True, start_method="forkserver")


multiprocessing.set_forkserver_preload(["torch", "torch.distributed", "zoe.torch"])


@pytest.fixture(scope="module")
def reference():
    return reference_parameters()


@pytest.fixture(scope="module")
def training_runs():
    """training_runs(N, **options): the full parameters and each rank's statistics of train()
    on N ranks with offload_parameters' ``options``, run once per (N, options) for the tests of
    this file."""
    runs = {}
    parent = tempfile.mkdtemp(prefix="zoe-zero3-", dir="/var/tmp" if os.path.isdir("/var/tmp")
                              else None)

    def run(world_size, **options):
        key = (world_size, tuple(sorted(options.items())))
        if key not in runs:
            directory = os.path.join(parent, str(len(runs)))
            os.makedirs(directory)
            run_ranks(train, world_size, directory, options)
            runs[key] = (
                torch.load(os.path.join(directory, "state.pt")),
                [torch.load(os.path.join(directory, f"stats{r}.pt")) for r in range(world_size)],
            )
        return runs[key]

    yield run
    shutil.rmtree(parent, ignore_errors=True)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_sharded_training_equals_one_process(world_size, training_runs, reference):
    state, stats = training_runs(world_size)
    for name, expected in reference.items():
        torch.testing.assert_close(state[name], expected, rtol=1e-4, atol=1e-5, msg=name)
    assert all(s["skipped"] == 1 for s in stats)  # the non-finite step, on every rank
    assert all(s["iterations"] == STEPS for s in stats)
    # After the recorded first iteration, gathers were issued ahead by the trace; the even
    # and odd iterations differ (even_only), so the trace is re-recorded as they alternate.
    assert all(s["gathers"]["prefetched"] > s["gathers"]["on_demand"] for s in stats)


# The gradient hooks run in this order (backward of forward's last module first; a tied
# weight's once, at its last use), with these sizes:
#   gate.bias 1, gate.weight 10, [even steps: even_only.bias 10, even_only.weight 100],
#   layers.3.bias 10, layers.3.weight 100, ... layers.0.bias 10, layers.0.weight 100,
#   scale 10, tokens.weight 110 (tied to head.weight)
# 14 gradients on even steps and 12 on odd ones. With buckets of 100 elements, a gradient of 100
# or more is reduced alone, and the smaller ones are bucketed until the end of backward:
#   even: the five 100s and the 110 alone, then [1, 10, 10, 10, 10, 10, 10, 10]: 7
#   odd:  the four 100s and the 110 alone, then [1, 10, 10, 10, 10, 10, 10]: 6
# The default (4 Mi elements) is one bucket per iteration, reduced at the end of backward.
BUCKET_COUNTS = {0: 10 * 14 + 10 * 12, 100: 10 * 7 + 10 * 6, None: STEPS}


@pytest.mark.parametrize("world_size", [2, 3])
def test_bucketed_reductions_equal_one_per_parameter_with_fewer_collectives(world_size,
                                                                            training_runs):
    # Buckets group parameters of uneven shards (10, 11 and 110 elements over 3 ranks) and
    # gate.bias, of 1 element: fewer than N, so some of its shards are empty. Each element is
    # summed over the ranks and divided by N whatever the bucket. On 2 ranks the sum has two
    # terms and a + b == b + a exactly, so the parameters are bit-identical. On 3 ranks gloo's
    # ring reduce adds an element's three terms in an order set by the element's position in
    # the reduced buffer, so a bucket may round a sum differently in its last bit: after 20
    # steps a few elements differ by ~3e-8, where a gradient in the wrong place moves
    # parameters by ~LR.
    expected_state = training_runs(world_size, bucket_elements=0)[0]
    for bucket_elements, count in BUCKET_COUNTS.items():
        options = {} if bucket_elements is None else {"bucket_elements": bucket_elements}
        state, stats = training_runs(world_size, **options)
        for name, expected in expected_state.items():
            if world_size == 2:
                assert torch.equal(state[name], expected), (bucket_elements, name)
            else:
                torch.testing.assert_close(state[name], expected, rtol=0, atol=LR * 1e-3,
                                           msg=f"{bucket_elements}: {name}")
        parameters = 10 * 14 + 10 * 12
        assert all(s["reductions"] == {"issued": count, "parameters": parameters}
                   for s in stats), (bucket_elements, [s["reductions"] for s in stats])
        assert all(s["skipped"] == 1 for s in stats)


def gathers_of(stats):
    return stats["gathers"]["prefetched"] + stats["gathers"]["on_demand"]


@pytest.mark.parametrize("world_size", [2, 3])
def test_parameters_kept_for_backward_are_not_gathered_again(world_size, training_runs):
    # Autograd saves the Linear weights, the tied head/tokens weight and the root's scale. By
    # default each is freed after its module's forward and gathered again for backward; kept
    # (DeepSpeed's stage3_max_live_parameters), backward uses the values forward gathered, so
    # every later use of a kept parameter is one gather fewer (the tied weight's use by head,
    # in forward, too: the embedding saves it), and the values trained are the same bits. 150
    # elements keep only what forward finished last (gate.weight 10, head.weight 110, scale
    # 10): fewer than keeping all, and less memory.
    plain_state, plain = training_runs(world_size)
    runs = {limit: training_runs(world_size, max_live_parameters=limit)
            for limit in (150, 10**9)}
    for state, stats in runs.values():
        for name, expected in plain_state.items():
            assert torch.equal(state[name], expected), name
        for before, after in zip(plain, stats):
            kept = after["gathers"]["kept"]
            assert kept > 0 and before["gathers"]["kept"] == 0
            assert gathers_of(before) - gathers_of(after) == kept
            assert after["gathered_bytes_at_end"] == before["gathered_bytes_at_end"] == 0
    limited, everything = (runs[limit][1][0] for limit in (150, 10**9))
    assert (0 < limited["gathers"]["kept"]
            < everything["gathers"]["kept"])
    assert plain[0]["peak_gathered_bytes"] < everything["peak_gathered_bytes"]


def test_bytes_held_per_rank_fall_with_the_number_of_ranks(training_runs):
    total = sum(p.numel() * p.element_size() for p in set(Model().parameters()))
    peaks = []
    for world_size in (1, 2, 3):
        stats = training_runs(world_size)[1]
        peak = max(s["peak_held_bytes"] for s in stats)
        shard_bytes = [s["shard_bytes"] for s in stats]
        assert sum(shard_bytes) == total  # the shards partition every parameter once
        # Each rank's shard is 1/N of the model, within one element per parameter.
        assert max(shard_bytes) <= total / world_size + 4 * 12
        peaks.append(peak)
    assert peaks[0] > peaks[1] > peaks[2]


FAILURE_TIMEOUT_S = 60  # the process group's in fail_on_rank_1; the failure takes < 1/3 of it


def fail_on_rank_1(rank, world_size, directory, damage="overwrite"):
    """Rank 1's parameter swap file is damaged before training: overwritten (its first gather
    reads a block whose checksum fails) or truncated to nothing (its first gather's read comes
    back short, at the end of the file). Each rank writes the error it got, how long it took and
    the sum of a collective made afterwards (the ranks still paired: 2)."""
    init(rank, world_size, directory, timeout_s=FAILURE_TIMEOUT_S)
    engine, paths = engine_for(directory, rank)
    torch.manual_seed(0)
    model = Model()
    pager = zoe.torch.offload_parameters(model, engine, process_group=dist.group.WORLD)
    if rank == 1:
        for path in (os.path.join(p, name) for p in paths for name in os.listdir(p)):
            if damage == "truncate":
                os.truncate(path, 0)
                continue
            with open(path, "r+b") as file:
                file.write(b"\x5a" * os.path.getsize(path))
    start = time.monotonic()
    outcome = "no error"
    try:
        for step in range(3):
            loss_of(model, step, slice(rank, rank + 1)).backward()
    except Exception as error:  # the outcome under test
        outcome = f"{type(error).__name__}: {error}"
        traceback.print_exc()
    seconds = time.monotonic() - start
    paired = torch.ones(1)
    dist.all_reduce(paired)
    with open(os.path.join(directory, f"outcome{rank}"), "w") as file:
        file.write(f"{seconds:.3f}\n{paired.item():g}\n{outcome}")
    del pager
    engine.close()


@pytest.mark.parametrize("damage, error", [("overwrite", "Corruption"),
                                           ("truncate", "IoError")])
def test_a_failing_rank_fails_every_rank_within_a_bound(nvme_dir, damage, error):
    run_ranks(fail_on_rank_1, 2, nvme_dir, damage)
    outcomes = []
    for rank in range(2):
        with open(os.path.join(nvme_dir, f"outcome{rank}")) as file:
            seconds, paired, outcome = file.read().split("\n", 2)
        outcomes.append(outcome)
        assert float(seconds) < FAILURE_TIMEOUT_S / 3, outcome
        assert paired == "2", (rank, paired)
    # rank 1 its own error, rank 0 Aborted with it: both name rank 1 and the parameter
    assert outcomes[1].startswith(f"{error}: gathering parameter "), outcomes[1]
    assert " failed on rank 1: " in outcomes[1], outcomes[1]
    assert outcomes[0].startswith("Aborted: gathering parameter "), outcomes[0]
    assert f" failed on rank 1 (rank 1: zoe.{error}: " in outcomes[0], outcomes[0]
    parameters = [outcome.split(": ", 1)[1].split(" failed")[0] for outcome in outcomes]
    assert parameters[0] == parameters[1], parameters  # the same gather on both ranks


def clip_by_hand_over_streamed_shards(rank, world_size, directory):
    """Rank's outcome of pager.clip_grad_norm_ once a zoe optimizer streams the shards'
    gradients (their .grad stays None, so clipping them by hand would clip nothing)."""
    init(rank, world_size, directory)
    engine, _ = engine_for(directory, rank)
    torch.manual_seed(0)
    model = Model()
    pager = zoe.torch.offload_parameters(model, engine, process_group=dist.group.WORLD)
    optimizer = zoe.torch.AdamW(pager.shard_parameters(), engine=engine)
    loss_of(model, 0, slice(rank, rank + 1)).backward()
    try:
        pager.clip_grad_norm_(1.0)
        outcome = "accepted"
    except zoe.InvalidArgument as error:
        outcome = str(error)
    optimizer.close()
    del pager
    engine.close()
    torch.save(outcome, os.path.join(directory, f"outcome{rank}.pt"))
    dist.destroy_process_group()


def test_clipping_streamed_shards_by_hand_is_refused_naming_max_grad_norm(nvme_dir):
    run_ranks(clip_by_hand_over_streamed_shards, 2, nvme_dir)
    for rank in range(2):
        outcome = torch.load(os.path.join(nvme_dir, f"outcome{rank}.pt"))
        assert "streams these shards' gradients" in outcome, outcome
        assert "max_grad_norm" in outcome, outcome


def step_with_nan_on_rank_0(rank, world_size, directory):
    """Three iterations calling optimizer.step(); in the second, rank 0's loss (so its part of
    every gradient) is NaN. Each rank saves its skips and steps taken."""
    init(rank, world_size, directory)
    engine, _ = engine_for(directory, rank)
    torch.manual_seed(0)
    model = Model()
    pager = zoe.torch.offload_parameters(model, engine, process_group=dist.group.WORLD)
    optimizer = zoe.torch.AdamW(pager.shard_parameters(), lr=LR, engine=engine)
    record = []
    for step in range(3):
        optimizer.zero_grad(set_to_none=True)
        loss = loss_of(model, step, slice(rank, rank + 1))
        if step == 1 and rank == 0:
            loss = loss * float("nan")
        loss.backward()
        optimizer.step()
        record.append((optimizer.last_step[0].skipped, optimizer._groups[0].zoe_group.steps))
    torch.save(record, os.path.join(directory, f"record{rank}.pt"))
    del pager
    engine.close()
    dist.destroy_process_group()


def test_an_inf_or_nan_on_one_rank_skips_the_step_on_every_rank(nvme_dir):
    run_ranks(step_with_nan_on_rank_0, 2, nvme_dir)
    for rank in range(2):
        record = torch.load(os.path.join(nvme_dir, f"record{rank}.pt"))
        assert record == [(False, 1), (True, 1), (False, 2)], (rank, record)


@pytest.fixture
def world_of_one(nvme_dir):
    """A gloo process group of this process alone, destroyed afterwards."""
    init(0, 1, nvme_dir)
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.mark.parametrize("stage, expected", [(3, 2), (1, 1)])
def test_a_sharded_optimizer_takes_its_stage_from_the_engine(world_of_one, stage, expected):
    config = small_config()
    config["zero_optimization"]["stage"] = stage
    with zoe.Engine(config) as engine:
        optimizer = zoe.torch.AdamW(torch.nn.Linear(4, 4).parameters(), engine=engine,
                                    process_group=world_of_one)
        assert optimizer.zero_stage == expected
        optimizer.close()


def test_a_sharded_optimizers_bucket_size_is_any_whole_number(world_of_one):
    import numpy

    for size, taken in ((5e8, 500_000_000), (numpy.int64(1024), 1024), (0, 0)):
        optimizer = zoe.torch.AdamW(torch.nn.Linear(4, 4).parameters(), zero_stage=1,
                                    process_group=world_of_one, bucket_elements=size)
        assert optimizer._zero.bucket_elements == taken
        optimizer.close()
    for size in (1.5, -5, "4M", True):
        with pytest.raises(zoe.InvalidArgument, match="bucket_elements"):
            zoe.torch.AdamW(torch.nn.Linear(4, 4).parameters(), zero_stage=1,
                            process_group=world_of_one, bucket_elements=size)


def test_a_sharded_optimizer_refuses_paged_parameters(world_of_one):
    with zoe.Engine(small_config(tensor_swap_bytes="8M")) as engine:
        layer = torch.nn.Linear(4, 4)
        zoe.torch.offload_parameters(layer, engine)
        with pytest.raises(zoe.InvalidArgument, match="parameter 0 of param group 0 is paged"):
            zoe.torch.AdamW(layer.parameters(), engine=engine, zero_stage=1,
                            process_group=world_of_one)


def reference_and_model():
    """Two models with the same seeded weights: a plain reference and one to page."""
    torch.manual_seed(0)
    reference, model = Model(), Model()
    model.load_state_dict(reference.state_dict())
    return reference, model


@pytest.mark.parametrize("tier", [zoe.Tier.HOST, zoe.Tier.DEVICE])
def test_gathered_only_while_used_and_given_back_by_remove(world_of_one, nvme_dir, tier):
    # DEVICE: the shards are paged into the engine's device tier (the host stand-in here).
    reference, model = reference_and_model()
    engine, _ = engine_for(nvme_dir, 0)
    with engine:
        pager = zoe.torch.offload_parameters(model, engine, process_group=world_of_one,
                                             tier=tier)
        for step in range(2):
            loss = loss_of(model, step, slice(None))
            # Nothing stays gathered between forward and backward (from the second iteration
            # on, the first gathers of backward are in flight, issued ahead by the trace).
            assert pager.gathered_bytes == 0
            assert (pager.in_flight_bytes > 0) == (step > 0)
            assert all(p.data.stride() == (0,) * p.dim() for p in model.parameters()
                       if p.numel() > 1)
            loss.backward()
            assert pager.gathered_bytes == pager.in_flight_bytes == 0
            assert all(p.grad is None for p in model.parameters())  # moved to the shards
            loss_of(reference, step, slice(None)).backward()
        for (name, p_ref), shard in zip(reference.named_parameters(), pager.shard_parameters()):
            assert torch.equal(shard.grad, p_ref.grad.view(-1)), name
        pager.remove()
        for (name, p_ref), p in zip(reference.named_parameters(), model.parameters()):
            assert torch.equal(p, p_ref), name


def test_a_parameter_without_a_gradient_is_left_out_of_its_bucket(world_of_one, nvme_dir):
    """An odd step leaves even_only without gradients: with buckets of 100 elements, the
    gradients that arrive are reduced (those of 100 elements or more alone, the rest together:
    BUCKET_COUNTS), and even_only's shards keep .grad None (the optimizer skips them) while every
    other shard gets its gradient, bit for bit."""
    reference, model = reference_and_model()
    engine, _ = engine_for(nvme_dir, 0)
    with engine:
        pager = zoe.torch.offload_parameters(model, engine, process_group=world_of_one,
                                             bucket_elements=100)
        loss_of(reference, 1, slice(None)).backward()
        loss_of(model, 1, slice(None)).backward()
        assert pager.stats()["reductions"] == {"issued": 6, "parameters": 12}
        for (name, p_ref), (shard_name, shard) in zip(reference.named_parameters(),
                                                       pager.named_shard_parameters()):
            assert name == shard_name
            if name.startswith("even_only."):
                assert p_ref.grad is None and shard.grad is None, name
            else:
                assert torch.equal(shard.grad, p_ref.grad.view(-1)), name


def test_a_torch_optimizer_steps_the_shards_inside_materialized(world_of_one, nvme_dir):
    reference, model = reference_and_model()
    engine, _ = engine_for(nvme_dir, 0)
    with engine:
        pager = zoe.torch.offload_parameters(model, engine, process_group=world_of_one)
        optimizers = [torch.optim.SGD(reference.parameters(), lr=0.1),
                      torch.optim.SGD(pager.shard_parameters(), lr=0.1)]
        for step in range(3):
            for optimizer in optimizers:
                optimizer.zero_grad(set_to_none=True)
            loss_of(reference, step, slice(None)).backward()
            loss_of(model, step, slice(None)).backward()
            optimizers[0].step()
            with pager.materialized():  # the shards point at their acquired memory
                optimizers[1].step()
        state = pager.state_dict()
        for name, expected in reference.state_dict().items():
            assert torch.equal(state[name], expected), name
        assert pager.gathered_bytes == pager.in_flight_bytes == 0


def test_the_pager_does_not_keep_a_destroyed_process_group(nvme_dir):
    """The pager, which the model's hooks keep, does not keep its process group alive past
    destroy_process_group() (a gloo group kept into interpreter shutdown aborts the process
    there); a forward afterwards raises FailedPrecondition naming it."""
    engine, _ = engine_for(nvme_dir, 0)
    with engine:
        init(0, 1, nvme_dir)
        try:
            group = weakref.ref(dist.group.WORLD)
            model = Model()
            zoe.torch.offload_parameters(model, engine, process_group=dist.group.WORLD)
            loss_of(model, 0, slice(None)).backward()
        finally:
            dist.destroy_process_group()
        assert group() is None, "the pager kept the destroyed process group alive"
        with pytest.raises(zoe.FailedPrecondition, match="destroy_process_group"):
            loss_of(model, 1, slice(None)).backward()


def test_bad_arguments_are_named(world_of_one, nvme_dir):
    engine, _ = engine_for(nvme_dir, 0)
    with engine:
        with pytest.raises(zoe.InvalidArgument, match="prefetch_depth = -1 .* allowed: >= 0"):
            zoe.torch.offload_parameters(Model(), engine, process_group=world_of_one,
                                         prefetch_depth=-1)
        model = Model()
        model.phase = torch.nn.Parameter(torch.ones(3, dtype=torch.complex64))
        before = {name: p.detach().clone() for name, p in model.named_parameters()}
        with pytest.raises(zoe.InvalidArgument, match="'phase': torch.complex64 cannot be "
                           "paged; allowed: torch.float32"):
            zoe.torch.offload_parameters(model, engine, process_group=world_of_one)
        for name, p in model.named_parameters():  # nothing was sharded
            assert torch.equal(p, before[name]), name
        for bad in (-1, 2.5, "64", True):
            with pytest.raises(zoe.InvalidArgument, match=f"bucket_elements = {bad!r} is not "
                               r"allowed; allowed: an integer >= 0 \(0 or 1: one parameter"):
                zoe.torch.offload_parameters(Model(), engine, process_group=world_of_one,
                                             bucket_elements=bad)
        # a size written as DeepSpeed's configurations write it is taken
        pager = zoe.torch.offload_parameters(Model(), engine, process_group=world_of_one,
                                             bucket_elements=4e6)
        assert pager.bucket_elements == 4_000_000
        with pytest.raises(zoe.InvalidArgument, match="norm_type = 1 .* allowed: 2.0"):
            pager.clip_grad_norm_(1.0, norm_type=1)


def test_a_process_group_without_init_process_group_is_refused(engine):
    assert not dist.is_initialized()
    with pytest.raises(zoe.InvalidArgument, match="init_process_group"):
        zoe.torch.offload_parameters(Model(), engine, process_group=object())


class Broken:
    """Stands in for a collective that fails (a peer died or timed out) when it is called, or
    (``in_wait``) when its asynchronous handle is waited for."""

    def __init__(self, function, in_wait=False):
        self.function = function
        self.in_wait = in_wait

    def __call__(self, *args, **kwargs):
        if self.in_wait:
            return self
        self.wait()

    def wait(self):
        raise RuntimeError(f"{self.function} failed: Connection closed by peer")


FIRST_BUCKET_OF_101 = ("reduction of the gradients of the bucket of 4 parameters 'gate.bias', "
                       "'gate.weight', 'even_only.bias', 'even_only.weight' failed")
EVERY_GRADIENT = ("reduction of the gradients of the bucket of 14 parameters 'gate.bias', "
                  "'gate.weight', .*, 'layers.2.weight' and 6 more failed")


@pytest.mark.parametrize(
    "collective, in_wait, when, bucket_elements, message",
    [
        ("broadcast", False, "forward", None, "gather of parameter 'scale'"),
        ("broadcast", True, "forward", None, "gather of parameter 'scale'"),
        ("reduce", False, "backward", 0, "reduction of the gradient of parameter 'gate.bias'"),
        ("reduce", True, "backward", 1, "reduction of the gradient of parameter 'gate.bias'"),
        # The first bucket fails as it is issued, or when the third makes room by waiting for it.
        # At 101 elements, the weights of 100 are bucketed with the smaller gradients before them.
        ("reduce", False, "backward", 101, FIRST_BUCKET_OF_101),
        ("reduce", True, "backward", 101, FIRST_BUCKET_OF_101),
        # The default: one bucket, reduced at the end of backward.
        ("reduce", True, "backward", None, EVERY_GRADIENT),
        ("all_reduce", False, "clip", None, "all_reduce of the gradient norm"),
    ],
)
def test_a_failed_collective_raises_aborted(world_of_one, nvme_dir, monkeypatch, collective,
                                             in_wait, when, bucket_elements, message):
    from zoe.torch import zero3

    engine, _ = engine_for(nvme_dir, 0)
    with engine:
        buckets = {} if bucket_elements is None else {"bucket_elements": bucket_elements}
        pager = zoe.torch.offload_parameters(Model(), engine, process_group=world_of_one,
                                             **buckets)
        if when != "forward":
            loss = loss_of(pager.model, 0, slice(None))
        if when == "clip":
            loss.backward()
        monkeypatch.setattr(zero3.dist, collective, Broken(collective, in_wait))
        with pytest.raises(zoe.Aborted, match=message) as raised:
            if when == "forward":
                loss_of(pager.model, 0, slice(None))
            elif when == "backward":
                loss.backward()
            else:
                pager.clip_grad_norm_(1.0)
        assert "Connection closed by peer" in str(raised.value)


def placeholders_only(model, pager):
    """Whether no parameter is gathered and every parameter and shard is its placeholder."""
    tensors = list(model.parameters()) + pager.shard_parameters()
    return (pager.gathered_bytes == pager.in_flight_bytes == 0
            and all(t.data.stride() == (0,) * t.dim() for t in tensors if t.numel() > 1))


def materialize_on_two_ranks(rank, world_size, directory):
    """Rank's outcomes of pager.materialized(): reads, writes through the full parameters and
    through the shards, writes under READ, a block raising on rank 1 only, a shard written both
    ways; after each, whether only placeholders are left and the full values then."""
    init(rank, world_size, directory)
    engine, _ = engine_for(directory, rank)
    torch.manual_seed(0)
    model = Model()
    pager = zoe.torch.offload_parameters(model, engine, process_group=dist.group.WORLD)
    loss_of(model, 0, slice(rank, rank + 1)).backward()  # a trained pager, gradients in shards
    record = {"before": pager.state_dict()}
    with pager.materialized(zoe.Access.READ):
        record["read"] = {name: p.detach().clone() for name, p in model.named_parameters()}
        for p in model.parameters():
            p.data.add_(1.0)  # dropped: READ
    record["after_read"] = (placeholders_only(model, pager), pager.state_dict())
    shifted = {key: value + 0.5 for key, value in record["before"].items()}
    with pager.materialized():
        model.load_state_dict(shifted)  # the same values on every rank
    record["after_load"] = (placeholders_only(model, pager), pager.state_dict())
    with pager.materialized():
        with torch.no_grad():
            for shard in pager.shard_parameters():
                shard.mul_(2.0)
    record["after_shards"] = (placeholders_only(model, pager), pager.state_dict())
    record["raised"] = outcome_of(raise_on_rank_1, pager, model, rank)
    record["after_raise"] = (placeholders_only(model, pager), pager.state_dict())
    record["both_ways"] = outcome_of(write_both_ways, pager, model, rank)
    record["after_both"] = (placeholders_only(model, pager), pager.state_dict())
    torch.save(record, os.path.join(directory, f"materialized{rank}.pt"))
    del pager
    engine.close()
    dist.destroy_process_group()


def outcome_of(function, *args):
    try:
        function(*args)
        return "no error"
    except Exception as error:  # the outcome under test
        return f"{type(error).__name__}: {error}"


def raise_on_rank_1(pager, model, rank):
    with pager.materialized():
        with torch.no_grad():
            for p in model.parameters():
                p.add_(3.0)  # dropped: the block raises on a rank
            pager.shard_parameters()[0].add_(1.0)  # dropped as well
        if rank == 1:
            raise ValueError("the block failed on purpose")


def write_both_ways(pager, model, rank):
    """Rank 1 writes 'scale' both ways; rank 0 through the full parameter only."""
    with pager.materialized():
        with torch.no_grad():
            model.scale.add_(1.0)
            if rank == 1:
                pager.named_shard_parameters()[1][1].add_(1.0)  # 'scale': index 1
                pager.shard_parameters()[0].add_(1.0)  # dropped too: the block is refused


def test_materialized_gathers_full_values_and_writes_back_each_ranks_shard(nvme_dir):
    run_ranks(materialize_on_two_ranks, 2, nvme_dir)
    records = [torch.load(os.path.join(nvme_dir, f"materialized{rank}.pt")) for rank in (0, 1)]
    for rank, record in enumerate(records):
        before = record["before"]
        for name, values in record["read"].items():
            assert torch.equal(values, before[name]), (rank, name)
        expected = {
            "after_read": before,
            "after_load": {key: value + 0.5 for key, value in before.items()},
            "after_shards": {key: (value + 0.5) * 2.0 for key, value in before.items()},
        }
        expected["after_raise"] = expected["after_both"] = expected["after_shards"]
        for stage, values in expected.items():
            only_placeholders, state = record[stage]
            assert only_placeholders, (rank, stage)
            assert state.keys() == values.keys()
            for key in values:
                assert torch.equal(state[key], values[key]), (rank, stage, key)
    assert records[1]["raised"] == "ValueError: the block failed on purpose"
    assert records[0]["raised"].startswith(
        "Aborted: the block inside pager.materialized() failed on rank 1 (rank 1: "), records[0]
    assert records[1]["both_ways"].startswith(
        "FailedPrecondition: checking the writes inside pager.materialized() failed on rank 1: "
        "parameter 'scale' was written inside pager.materialized() both"), records[1]
    assert records[0]["both_ways"].startswith(
        "Aborted: checking the writes inside pager.materialized() failed on rank 1 "), records[0]


def test_a_torch_optimizer_steps_the_shards_inside_shards_materialized(world_of_one, nvme_dir):
    reference, model = reference_and_model()
    engine, _ = engine_for(nvme_dir, 0)
    with engine:
        pager = zoe.torch.offload_parameters(model, engine, process_group=world_of_one)
        optimizers = [torch.optim.SGD(reference.parameters(), lr=0.1),
                      torch.optim.SGD(pager.shard_parameters(), lr=0.1)]
        for step in range(2):
            for optimizer in optimizers:
                optimizer.zero_grad(set_to_none=True)
            loss_of(reference, step, slice(None)).backward()
            loss_of(model, step, slice(None)).backward()
            optimizers[0].step()
            with pager.shards_materialized() as shards:  # no gather: the shards only
                assert pager.gathered_bytes == 0 and shards == pager.shard_parameters()
                optimizers[1].step()
        state = pager.state_dict()
        for name, expected in reference.state_dict().items():
            assert torch.equal(state[name], expected), name
        assert placeholders_only(model, pager)


def test_a_zero_stage_1_or_2_optimizer_over_stage_3_parameters_is_refused(world_of_one,
                                                                           nvme_dir):
    from zoe.torch.stage3_checks import check_optimizer_parameter

    engine, _ = engine_for(nvme_dir, 0)
    with engine:
        model = Model()
        pager = zoe.torch.offload_parameters(model, engine, process_group=world_of_one)
        for param, kind in ((model.scale, "a parameter of a model sharded"),
                            (pager.shard_parameters()[0], "a shard of")):
            for stage in (1, 2):
                with pytest.raises(zoe.InvalidArgument, match=kind) as caught:
                    check_optimizer_parameter(param, "parameter 0 of param group 0", stage)
                assert f"zero_stage={stage} would partition it again" in str(caught.value)
                assert "zoe.torch.AdamW(pager.shard_parameters(), engine=engine)" in \
                    str(caught.value)
            check_optimizer_parameter(param, "parameter 0", None)  # unsharded: stage 3's own
        check_optimizer_parameter(torch.nn.Parameter(torch.ones(2)), "parameter 0", 2)


@pytest.mark.parametrize("sharded", [True, False], ids=["sharded", "one_process"])
def test_state_dict_of_placeholders_is_refused_outside_materialized(world_of_one, nvme_dir,
                                                                    sharded):
    """In one process as over ranks: state_dict() outside materialized() would hold the NaN
    placeholders (one process gave them silently)."""
    engine, _ = engine_for(nvme_dir, 0)
    with engine:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
        expected = {key: value.clone() for key, value in model.state_dict().items()}
        pager = zoe.torch.offload_parameters(model, engine,
                                             process_group=world_of_one if sharded else None)
        every_rank = r" on every rank \(a collective\)" if sharded else ""
        for call in (model.state_dict, model[0].state_dict):
            with pytest.raises(zoe.InvalidArgument,
                               match=r"state_dict\(\) of a model whose parameters .* would see "
                                     r"the placeholders \(NaN\) .*: call "
                                     r"engine.module_state_dict\(\) \(without initialize: "
                                     rf"pager.state_dict\(\)\) for the values{every_rank}, or "
                                     r"do it inside `with pager.materialized\(\):`"):
                call()
        with pytest.raises(zoe.InvalidArgument, match="load_state_dict.. of '0.weight' .* "
                                                      "load_module_only=True"):
            model.load_state_dict(expected)
        buffers = {key: value + 1 for key, value in expected.items() if "running" in key}
        model.load_state_dict(buffers, strict=False)  # buffers only: no placeholder written
        state = pager.state_dict()
        with pager.materialized(zoe.Access.READ):
            inside = model.state_dict()
            for key, value in state.items():
                assert torch.equal(inside[key], value), key
        for key, value in expected.items():
            assert torch.equal(state[key], buffers.get(key, value)), key
        pager.remove()
        model.state_dict()  # ordinary parameters again


def test_the_finite_check_agrees_with_isfinite_on_every_kind_of_tensor():
    from zoe.torch.zero3 import _all_finite

    inf, nan = float("inf"), float("nan")
    cases = [torch.randn(1000), torch.zeros(0), torch.tensor([1.0, inf]),
             torch.tensor([nan, 1.0]), torch.tensor([inf, -inf]),
             torch.full((10,), 3e38),  # finite values whose sum overflows
             torch.full((10,), 60000.0, dtype=torch.float16),
             torch.tensor([1.0, -inf], dtype=torch.bfloat16)]
    for tensor in cases:
        assert _all_finite(tensor) == bool(torch.isfinite(tensor).all()), tensor


def materialize_failing_on_rank_1(rank, world_size, directory):
    """Rank 1 fails to acquire its shards for materialized(), then to write them back; each rank
    records its outcomes, whether only placeholders were left and the values afterwards."""
    init(rank, world_size, directory)
    engine, _ = engine_for(directory, rank)
    torch.manual_seed(0)
    model = Model()
    pager = zoe.torch.offload_parameters(model, engine, process_group=dist.group.WORLD)
    before = pager.state_dict()
    failing = {}
    if rank == 1:
        def fail(name):
            def raising(*_):
                raise zoe.IoError(zoe._capi.Status.IO, f"{name} failed on purpose")
            return raising
        failing = {"_acquire_shards": fail("acquire"), "_write_back": fail("write-back")}
    record = {}
    for method in ("_acquire_shards", "_write_back"):
        if method in failing:
            setattr(pager, method, failing[method])
        record[method] = outcome_of(shift_inside_materialized, pager, model)
        if method in failing:
            delattr(pager, method)
        record[method + " after"] = (placeholders_only(model, pager), pager.state_dict())
    record["before"] = before
    torch.save(record, os.path.join(directory, f"failing{rank}.pt"))
    del pager
    engine.close()
    dist.destroy_process_group()


def shift_inside_materialized(pager, model):
    with pager.materialized():
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)


def test_materialized_fails_on_every_rank_when_one_cannot_acquire_or_write_back(nvme_dir):
    run_ranks(materialize_failing_on_rank_1, 2, nvme_dir)
    records = [torch.load(os.path.join(nvme_dir, f"failing{rank}.pt")) for rank in (0, 1)]
    for step, what in (("_acquire_shards", "acquiring this rank's shards"),
                       ("_write_back", "writing back the parameters")):
        assert records[1][step].startswith(
            f"IoError: {what}"), records[1][step]
        assert " failed on rank 1: " in records[1][step], records[1][step]
        assert records[0][step].startswith(f"Aborted: {what}"), records[0][step]
        assert "failed on rank 1 (rank 1: zoe.IoError: " in records[0][step], records[0][step]
    for rank, record in enumerate(records):
        before = record["before"]
        for step in ("_acquire_shards", "_write_back"):
            only_placeholders, state = record[step + " after"]
            assert only_placeholders, (rank, step)
            for key, value in state.items():
                # after the failed acquire nothing is kept; after the failed write-back rank 0
                # has written its slice of each parameter and rank 1 nothing
                expected = before[key].clone()
                if step == "_write_back":
                    expected.view(-1)[: shard_counts(expected.numel(), 2)[0]] += 1.0
                assert torch.equal(value, expected), (rank, step, key)


def materialize_with_a_damaged_rank_1(rank, world_size, directory):
    """Rank 1's parameter swap files are overwritten before materialized(): its first gather
    cannot read the shard. Each rank records its outcome, what is left gathered or in flight,
    and the sum of a collective made afterwards (the ranks still paired: 2)."""
    init(rank, world_size, directory, timeout_s=FAILURE_TIMEOUT_S)
    engine, paths = engine_for(directory, rank)
    torch.manual_seed(0)
    model = Model()
    pager = zoe.torch.offload_parameters(model, engine, process_group=dist.group.WORLD)
    if rank == 1:
        for path in (os.path.join(p, name) for p in paths for name in os.listdir(p)):
            with open(path, "r+b") as file:
                file.write(b"\x5a" * os.path.getsize(path))
    outcome = outcome_of(shift_inside_materialized, pager, model)
    left = (placeholders_only(model, pager), len(pager._pending))
    paired = torch.ones(1)
    dist.all_reduce(paired)
    torch.save((outcome, left, paired.item()), os.path.join(directory, f"damaged{rank}.pt"))
    del pager
    engine.close()
    dist.destroy_process_group()


def test_materialized_with_an_unreadable_shard_fails_on_every_rank_and_frees_all(nvme_dir):
    run_ranks(materialize_with_a_damaged_rank_1, 2, nvme_dir)
    outcomes = [torch.load(os.path.join(nvme_dir, f"damaged{rank}.pt")) for rank in (0, 1)]
    assert outcomes[1][0].startswith("Corruption: gathering parameter "), outcomes[1][0]
    assert outcomes[0][0].startswith("Aborted: gathering parameter "), outcomes[0][0]
    for outcome, left, paired in outcomes:
        assert left == (True, 0) and paired == 2, (outcome, left, paired)
