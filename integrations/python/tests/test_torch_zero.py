"""zoe.torch.AdamW / Adam / Adagrad / Lion sharded across ranks (ZeRO stages 1 and 2,
process_group=...): 2 and 3 ranks spawned with torch.multiprocessing over gloo train 20 steps and
end with the parameters of one unsharded process within fp32 tolerance (bf16 parameters within two
bf16 steps; the updated parameters moved by broadcast, or by all-gather as over NCCL) -- with
uneven shards (parameters split across ranks), clipping active, a skipped (NaN) step, a
parameter without a gradient on some steps and a parameter written outside the optimizer between
two steps (as by load_state_dict); each rank's optimizer state on disk is 1/N of the total
(within one chunk); the stage comes from the engine config too; state_dict() consolidates every
shard into torch's layout and a one-process state dict loads onto 2 and 3 ranks and continues
alike; a sharded checkpoint (one per rank and a manifest) loads bit-identically and training
resumes as if uninterrupted; a rank whose state fails its checksum on read makes every rank's step
raise within the transport's timeout, never a hang; an optimizer (closed or not, referenced or not)
never keeps its process group alive past destroy_process_group()."""

import contextlib
import ctypes
import gc
import glob
import os
import weakref

import pytest
import torch
import torch.distributed as dist

import zoe
import zoe.torch
from conftest import gloo_rank, small_config, spawn_ranks

STEPS = 20
NAN_STEP = 7
BATCH = 12  # divisible by 2 and 3: every rank averages the same number of samples
SUB_GROUP = 256
MAX_GRAD_NORM = 0.5
EXTERNAL_WRITE_STEP = 3  # parameters written outside the optimizer before this step
JOIN_SECONDS = 90


class Net(torch.nn.Module):
    """Parameters of uneven sizes (so shards cut parameters) and ``extra``, used on even steps
    only (no gradient on odd steps, on every rank)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.l1 = torch.nn.Linear(23, 41)
        self.l2 = torch.nn.Linear(41, 7)
        self.extra = torch.nn.Parameter(torch.randn(7) * 0.1)

    def forward(self, x, step):
        out = self.l2(torch.tanh(self.l1(x)))
        if step % 2 == 0:
            out = out * (1 + self.extra)
        return out


def batch(step):
    generator = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(BATCH, 23, generator=generator)
    y = torch.randn(BATCH, 7, generator=generator)
    if step == NAN_STEP:
        x[0, 0] = float("inf")  # sample 0, on rank 0: a NaN gradient, a skipped step
    return x, y


def train(optimizer, model, rank, world, steps=STEPS, first=0):
    dtype = next(model.parameters()).dtype
    for step in range(first, first + steps):
        if step == EXTERNAL_WRITE_STEP:  # as load_state_dict between steps, on every rank
            with torch.no_grad():
                model.l1.weight.mul_(0.5)
        x, y = (values.to(dtype) for values in batch(step))
        per_rank = BATCH // world
        rows = slice(rank * per_rank, (rank + 1) * per_rank)
        x, y = x[rows], y[rows]
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x, step).float(), y.float())  # fp32 loss
        loss.backward()
        optimizer.step()


ACCUMULATION_STEPS = 6


def train_accumulating(optimizer, model, rank, world, hold=True):
    """Each step over two micro-batches (the halves of the rank's rows, each loss halved), the
    first backward inside optimizer.no_sync() when ``hold``."""
    for step in range(ACCUMULATION_STEPS):
        x, y = batch(step)
        per_rank = BATCH // world
        rows = slice(rank * per_rank, (rank + 1) * per_rank)
        x, y = x[rows], y[rows]
        half = per_rank // 2
        optimizer.zero_grad(set_to_none=True)
        first = optimizer.no_sync() if hold else contextlib.nullcontext()
        with first:
            (torch.nn.functional.mse_loss(model(x[:half], step), y[:half]) / 2).backward()
        (torch.nn.functional.mse_loss(model(x[half:], step), y[half:]) / 2).backward()
        optimizer.step()


def run_accumulation(rank, world, out_dir, name, hold):
    model = Net()
    optimizer = make_optimizer("AdamW", model.parameters(),
                               os.path.join(out_dir, name + "-nvme-{rank}"),
                               process_group=dist.group.WORLD, zero_stage=2, bucket_elements=100)
    train_accumulating(optimizer, model, rank, world, hold=hold)
    torch.save([p.detach().clone() for p in model.parameters()],
               os.path.join(out_dir, f"{name}-rank{rank}.pt"))
    optimizer.close()


def make_optimizer(kind, params, nvme_path, config_stage=3, buffer_count=4, **options):
    """A zoe optimizer with its state on NVMe in sub-groups of SUB_GROUP, clipping at
    MAX_GRAD_NORM; ``config_stage``: the config's zero_optimization.stage; ``buffer_count``:
    pipeline buffers (fewer than the shard's chunks: every step reads some state from disk)."""
    config = small_config(nvme_path, offload="nvme")
    config["zero_optimization"].update(stage=config_stage, sub_group_size=SUB_GROUP)
    config["zero_optimization"]["offload_optimizer"]["buffer_count"] = buffer_count
    cls = getattr(zoe.torch, kind.partition(":")[0])
    return cls(params, lr=0.02, weight_decay=0.01, max_grad_norm=MAX_GRAD_NORM, config=config,
               **options)


def state_bytes(directory):
    """Bytes of the optimizer swap files under ``directory``."""
    return sum(os.path.getsize(path) for path in glob.glob(os.path.join(directory, "**",
                                                                         "zoe-optimizer-*"),
                                                       recursive=True))


def model_of(kind):
    """Net in the dtype ``kind`` names after a colon ("AdamW:bfloat16"), else fp32."""
    _, _, dtype = kind.partition(":")
    return Net().to(getattr(torch, dtype)) if dtype else Net()


@contextlib.contextmanager
def all_gather_transport():
    """The sharded groups made inside move the updated parameters by all-gather, as over NCCL
    (TorchCollectives offers zoe no broadcast)."""
    from zoe.torch.distributed import TorchCollectives
    offers = TorchCollectives._offers_broadcast
    TorchCollectives._offers_broadcast = lambda self: False
    try:
        yield
    finally:
        TorchCollectives._offers_broadcast = offers


def run_training(rank, world, out_dir, name, kind, stage):
    """One sharded run (``name`` ending in "-allgather": by all_gather_transport); its results
    go to <out_dir>/<name>-rank<rank>.pt."""
    transport = all_gather_transport() if name.endswith("-allgather") else contextlib.nullcontext()
    with transport:
        train_sharded(rank, world, out_dir, name, kind, stage)


def train_sharded(rank, world, out_dir, name, kind, stage):
    model = model_of(kind)
    options = {"process_group": dist.group.WORLD, "bucket_elements": 100}
    if stage == "config":
        options["config_stage"] = 1
    else:
        options["zero_stage"] = stage
    nvme = os.path.join(out_dir, name + "-nvme-{rank}")
    optimizer = make_optimizer(kind, model.parameters(), nvme, **options)
    train(optimizer, model, rank, world)
    torch.save(
        {"params": [p.detach().clone() for p in model.parameters()],
         "state": optimizer.state_dict()["state"],
         "state_bytes": state_bytes(nvme.replace("{rank}", str(rank))),
         "stage": optimizer.zero_stage,
         "broadcast": bool(optimizer._zero.comm.struct.broadcast)},
        os.path.join(out_dir, f"{name}-rank{rank}.pt"),
    )
    optimizer.close()


def run_checkpoint(rank, world, out_dir):
    """10 steps straight, and 5 steps, a sharded checkpoint, a fresh model and optimizer that
    load it and 5 more steps: the parameters must be the same bits."""
    def fresh(name):
        model = Net()
        optimizer = make_optimizer("AdamW", model.parameters(),
                                   os.path.join(out_dir, name + "-nvme-{rank}"),
                                   process_group=dist.group.WORLD, zero_stage=2,
                                   bucket_elements=100)
        return model, optimizer

    straight, straight_opt = fresh("straight")
    train(straight_opt, straight, rank, world, steps=10)
    first, first_opt = fresh("first")
    train(first_opt, first, rank, world, steps=5)
    directory = os.path.join(out_dir, "checkpoint")
    first_opt.save_checkpoint(directory)
    resumed, resumed_opt = fresh("resumed")
    resumed_opt.load_checkpoint(directory)
    loaded = [torch.equal(a, b) for a, b in zip(resumed.parameters(), first.parameters())]
    train(resumed_opt, resumed, rank, world, steps=5, first=5)
    torch.save(
        {"loaded_equal": loaded,
         "resumed_equal": [torch.equal(a, b) for a, b in zip(resumed.parameters(),
                                                              straight.parameters())],
         "files": sorted(os.listdir(directory))},
        os.path.join(out_dir, f"ckpt-rank{rank}.pt"),
    )
    for optimizer in (straight_opt, first_opt, resumed_opt):
        optimizer.close()


def run_state_dict(rank, world, out_dir):
    """10 sharded steps, then the consolidated state dict (rank 0 saves it); and a fresh sharded
    optimizer that loads the one-process state dict of step 10 (another world size) and takes
    steps 10..19 (its parameters saved per rank)."""
    model = Net()
    optimizer = make_optimizer("AdamW", model.parameters(),
                               os.path.join(out_dir, "sd-nvme-{rank}"),
                               process_group=dist.group.WORLD, zero_stage=1)
    train(optimizer, model, rank, world, steps=10)
    consolidated = optimizer.state_dict()
    if rank == 0:
        torch.save(consolidated, os.path.join(out_dir, "sd-consolidated.pt"))
    optimizer.close()
    saved = torch.load(os.path.join(out_dir, "reference10.pt"))
    model = Net()
    with torch.no_grad():
        for param, value in zip(model.parameters(), saved["params"]):
            param.copy_(value)
    optimizer = make_optimizer("AdamW", model.parameters(),
                               os.path.join(out_dir, "sd-resumed-nvme-{rank}"),
                               process_group=dist.group.WORLD, zero_stage=2, bucket_elements=100)
    optimizer.load_state_dict(saved["state_dict"])
    train(optimizer, model, rank, world, steps=10, first=10)
    torch.save([p.detach().clone() for p in model.parameters()],
               os.path.join(out_dir, f"sd-rank{rank}.pt"))
    optimizer.close()


def run_fault(rank, world, out_dir):
    """Two steps, then rank 1's state file is overwritten and two more steps are tried; what
    each rank's step raised goes to <out_dir>/error<rank>.txt."""
    model = Net()
    nvme = os.path.join(out_dir, "fault-nvme-{rank}")
    optimizer = make_optimizer("AdamW", model.parameters(), nvme, buffer_count=2,
                               process_group=dist.group.WORLD, zero_stage=2)
    train(optimizer, model, rank, world, steps=2)
    if rank == 1:  # the shard's state on disk no longer matches its checksums
        for path in glob.glob(os.path.join(out_dir, f"fault-nvme-{rank}", "zoe-optimizer-*")):
            with open(path, "r+b") as file:
                file.write(b"\xa5" * os.path.getsize(path))
    try:
        train(optimizer, model, rank, world, steps=2)
        message = "no error"
    except zoe.Error as error:
        message = f"{type(error).__name__}: {error}"
    with open(os.path.join(out_dir, f"error{rank}.txt"), "w") as file:
        file.write(message)


def reused_buffers(optimizer):
    """The optimizer's reused buffers: per param group its flat gradient buffer, and the
    collectives' scratch buffers by purpose and size."""
    return {"grads": [state.shard.place.buffer for state in optimizer._groups],
            **optimizer._zero.comm._scratch}


def run_buffers(rank, world, out_dir):
    """Stage 1 and 2, 8 steps each (the NaN step and steps without ``extra``'s gradient among
    them). Saved to <out_dir>/buffers-rank<rank>.pt, per stage: the buffers' names after the
    first step and, per later step, whether each buffer is the first step's tensor at the same
    address (the first step's tensors are held, so a new one cannot take their memory)."""
    results = {}
    for stage in (1, 2):
        model = Net()
        optimizer = make_optimizer("AdamW", model.parameters(),
                                   os.path.join(out_dir, f"buffers{stage}-nvme-{{rank}}"),
                                   process_group=dist.group.WORLD, zero_stage=stage,
                                   bucket_elements=100)
        train(optimizer, model, rank, world, steps=1)
        first = reused_buffers(optimizer)
        same = []
        for step in range(1, 8):
            train(optimizer, model, rank, world, steps=1, first=step)
            found = reused_buffers(optimizer)
            same.append(found.keys() == first.keys() and all(
                _same_tensors(found[key], first[key]) for key in first))
        results[stage] = {"names": sorted(map(str, first)), "grads": len(first["grads"]),
                          "same": same}
        optimizer.close()
    torch.save(results, os.path.join(out_dir, f"buffers-rank{rank}.pt"))


def _same_tensors(found, first):
    if isinstance(first, list):
        return len(found) == len(first) and all(map(_same_tensors, found, first))
    return found is first and found.data_ptr() == first.data_ptr()


def run_gather(rank, world, out_dir):
    """TorchCollectives.gather of even, uneven and empty shards, twice each (the second time with
    other values): every rank's shard in rank order; and its
    reduce-scatter callback, twice per layout: the sum of the ranks' slices, the sender's buffer
    left as it was."""
    from zoe.torch.distributed import TorchCollectives

    comm = TorchCollectives(dist.group.WORLD)
    gathered = []
    for counts in ([3] * world, [2 + r for r in range(world)], [0] * world,
                   [0] + [2] * (world - 1), [2] * (world - 1) + [0]):
        for sign in (1.0, -1.0):
            shard = sign * (torch.arange(counts[rank], dtype=torch.float32) + 100 * rank)
            gathered.append((counts, sign, comm.gather(shard, counts, "test values").tolist()))
    scattered = []
    for counts in ([3] * world, [2 + r for r in range(world)], [0] + [2] * (world - 1)):
        for sign in (1.0, -1.0):  # the second time through the reused buffer
            send = sign * (torch.arange(sum(counts), dtype=torch.float32) + 1000 * rank)
            sent = send.clone()
            recv = torch.empty(counts[rank], dtype=torch.float32)
            comm._reduce_scatter_sum(send.data_ptr(), recv.data_ptr(),
                                     (ctypes.c_uint64 * world)(*counts))
            scattered.append((counts, sign, recv.tolist(), torch.equal(send, sent)))
    torch.save({"gathered": gathered, "scattered": scattered},
               os.path.join(out_dir, f"gather-rank{rank}.pt"))


def worker(rank, world, init_file, out_dir, runs):
    """``runs``: (name, kind, stage) of the training runs to make, or "fault"."""
    with gloo_rank(rank, world, init_file, out_dir, timeout_seconds=20):
        if runs == "fault":
            run_fault(rank, world, out_dir)
            return
        for name, kind, stage in runs:
            if name == "buffers":
                run_buffers(rank, world, out_dir)
            elif name == "gather":
                run_gather(rank, world, out_dir)
            elif name == "ckpt":
                run_checkpoint(rank, world, out_dir)
            elif name == "sd":
                run_state_dict(rank, world, out_dir)
            elif name in ("accum", "accum-unheld"):
                run_accumulation(rank, world, out_dir, name, hold=name == "accum")
            else:
                run_training(rank, world, out_dir, name, kind, stage)


def spawn(world, out_dir, runs):
    """Runs ``worker`` on ``world`` spawned ranks; fails on a crash or after JOIN_SECONDS."""
    spawn_ranks(worker, (world, os.path.join(out_dir, "init"), out_dir, runs), world, out_dir,
                JOIN_SECONDS)


def reference(kind, directory):
    """The unsharded run in this process, its state in ``directory``."""
    os.makedirs(directory, exist_ok=True)
    model = model_of(kind)
    optimizer = make_optimizer(kind, model.parameters(), directory)
    train(optimizer, model, 0, 1)
    params = [p.detach().clone() for p in model.parameters()]
    total = state_bytes(directory)
    state = optimizer.state_dict()["state"]
    optimizer.close()
    return params, total, state


# Per world size, the runs one spawn makes: stage 1 and 2, AdamW, Adam, Adagrad and Lion, the
# stage from the config (1; its zero_stage left out).
RUNS = {
    2: [("s1", "AdamW", 1), ("s2", "AdamW", 2), ("config", "AdamW", "config"),
        ("ckpt", "AdamW", 2), ("sd", "AdamW", 1), ("bf16", "AdamW:bfloat16", 2),
        ("s2-allgather", "AdamW", 2), ("lion-s2", "Lion", 2), ("adagrad-s1", "Adagrad", 1)],
    3: [("s1", "AdamW", 1), ("s2", "Adam", 2), ("sd", "AdamW", 1), ("lion-s1", "Lion", 1),
        ("adagrad-s2", "Adagrad", 2)],
}


def prepare_state_dict(out_dir):
    """One process: the state dict and parameters after 10 steps (saved for the ranks to load)
    and the parameters after 20."""
    directory = os.path.join(out_dir, "sd-single")
    os.makedirs(directory, exist_ok=True)
    model = Net()
    optimizer = make_optimizer("AdamW", model.parameters(), directory)
    train(optimizer, model, 0, 1, steps=10)
    state = optimizer.state_dict()
    torch.save({"state_dict": state, "params": [p.detach().clone() for p in model.parameters()]},
               os.path.join(out_dir, "reference10.pt"))
    train(optimizer, model, 0, 1, steps=10, first=10)
    optimizer.close()
    return state, [p.detach().clone() for p in model.parameters()]


def check_state_dict(out_dir, world, want_state, want_params):
    """The consolidated state dict is one process's, in torch's layout; loaded on ``world`` ranks
    the one-process state of step 10 continues as one process does."""
    got = torch.load(os.path.join(out_dir, "sd-consolidated.pt"))
    assert got["param_groups"] == want_state["param_groups"]
    assert sorted(got["state"]) == sorted(want_state["state"])
    for index, entry in want_state["state"].items():
        assert sorted(got["state"][index]) == sorted(entry) == ["exp_avg", "exp_avg_sq", "step"]
        assert float(got["state"][index]["step"]) == float(entry["step"])
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(got["state"][index][key], entry[key], rtol=2e-5,
                                       atol=1e-7, msg=f"parameter {index} {key}")
    for rank in range(world):
        params = torch.load(os.path.join(out_dir, f"sd-rank{rank}.pt"))
        for index, (a, b) in enumerate(zip(params, want_params)):
            torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-6,
                                       msg=f"resumed from a state dict: rank {rank} param {index}")


def check_checkpoint(out_dir, world):
    for rank in range(world):
        got = torch.load(os.path.join(out_dir, f"ckpt-rank{rank}.pt"))
        assert all(got["loaded_equal"]), got["loaded_equal"]
        assert all(got["resumed_equal"]), got["resumed_equal"]
        assert got["files"] == ["rank-0", "rank-1", "zoe_sharded_manifest.json"], got["files"]


def tolerance(dtype):
    """fp32: within fp32 rounding. bf16 parameters (each rank's part broadcast in bf16 into the
    peers'): the ranks average fp32 copies of bf16 gradients of part of the batch where one
    process takes the bf16 gradient of the whole batch, so the values may differ by two bf16
    steps at these magnitudes (under 0.5); a part put in the wrong place would be off by the
    parameters' own size."""
    return dict(rtol=0, atol=2 ** -8) if dtype == torch.bfloat16 else dict(rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("world", [2, 3])
def test_sharded_equals_one_process(world, nvme_dir):
    want_state, want_params = prepare_state_dict(nvme_dir)
    spawn(world, nvme_dir, RUNS[world])
    chunk = 2 * 3 * 4096  # both slots of one chunk: master, exp_avg, exp_avg_sq
    for name, kind, stage in RUNS[world]:
        if name == "ckpt":
            check_checkpoint(nvme_dir, world)
            continue
        if name == "sd":
            check_state_dict(nvme_dir, world, want_state, want_params)
            continue
        want, total, single_state = reference(kind, os.path.join(nvme_dir, f"{name}-single"))
        for rank in range(world):
            got = torch.load(os.path.join(nvme_dir, f"{name}-rank{rank}.pt"))
            assert got["stage"] == (1 if stage == "config" else stage)
            assert got["broadcast"] == (not name.endswith("-allgather"))
            for index, (a, b) in enumerate(zip(got["params"], want)):
                torch.testing.assert_close(a, b, **tolerance(a.dtype),
                                           msg=f"{name}: rank {rank} parameter {index}")
            # the gathered state dict holds the kind's moments, in torch's names
            assert sorted(got["state"]) == sorted(single_state)
            for index, entry in single_state.items():
                assert sorted(got["state"][index]) == sorted(entry), (name, index)
                for key, values in entry.items():
                    torch.testing.assert_close(got["state"][index][key], values,
                                               **tolerance(got["params"][0].dtype),
                                               msg=f"{name}: rank {rank} {key} of {index}")
            assert abs(got["state_bytes"] - total / world) <= chunk, (got["state_bytes"], total)


def test_stage2_accumulation_holds_reductions_inside_no_sync(nvme_dir):
    """Gradient accumulation over two micro-batches at stage 2 on 2 ranks, the first backward
    inside optimizer.no_sync(), equals one process accumulating the same losses; without
    no_sync the first micro-batch's buckets are reduced alone and the result differs."""
    directory = os.path.join(nvme_dir, "accum-single")
    os.makedirs(directory, exist_ok=True)
    model = Net()
    optimizer = make_optimizer("AdamW", model.parameters(), directory)
    with optimizer.no_sync():  # unsharded: nothing to hold
        pass
    train_accumulating(optimizer, model, 0, 1)
    want = [p.detach().clone() for p in model.parameters()]
    optimizer.close()
    spawn(2, nvme_dir, [("accum", None, 2), ("accum-unheld", None, 2)])
    for rank in range(2):
        got = torch.load(os.path.join(nvme_dir, f"accum-rank{rank}.pt"))
        for index, (a, b) in enumerate(zip(got, want)):
            torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-6,
                                       msg=f"rank {rank} parameter {index}")
        unheld = torch.load(os.path.join(nvme_dir, f"accum-unheld-rank{rank}.pt"))
        assert any(not torch.allclose(a, b, rtol=2e-5, atol=2e-6) for a, b in zip(unheld, want))


def test_steady_state_steps_reuse_their_buffers(nvme_dir):
    """Stages 1 and 2 build no full-size buffer per step: the flat gradient buffers and the
    collectives' scratch buffers are the same memory after every step (the shards are uneven;
    gloo's gather and reductions need no scratch buffer); and the gather returns every call's
    values, as does the reduce-scatter callback through its reused buffer, with empty shards
    among them."""
    world = 2
    spawn(world, nvme_dir, [("buffers", None, None), ("gather", None, None)])
    for rank in range(world):
        results = torch.load(os.path.join(nvme_dir, f"buffers-rank{rank}.pt"))
        for stage, result in results.items():
            assert result["grads"] == 1, result
            assert result["names"] == ["grads"], result
            assert result["same"] == [True] * 7, (stage, result)
        collectives = torch.load(os.path.join(nvme_dir, f"gather-rank{rank}.pt"))
        for counts, sign, got in collectives["gathered"]:
            want = [sign * (index + 100 * r) for r in range(world) for index in range(counts[r])]
            assert got == want, (counts, sign, got)
        for counts, sign, got, send_unchanged in collectives["scattered"]:
            begin = sum(counts[:rank])
            want = [sign * sum(index + 1000 * r for r in range(world))
                    for index in range(begin, begin + counts[rank])]
            assert got == want and send_unchanged, (counts, sign, got, send_unchanged)


def test_reference_run_clips_skips_and_leaves_params_alone(nvme_dir):
    """The scenario really exercises what the sharded tests compare: the NaN step skips, the
    norm exceeds max_grad_norm, and ``extra`` has no gradient on odd steps."""
    model = Net()
    os.makedirs(os.path.join(nvme_dir, "one"), exist_ok=True)
    optimizer = make_optimizer("AdamW", model.parameters(), os.path.join(nvme_dir, "one"))
    skipped, norms = [], []
    for step in range(NAN_STEP + 1):
        x, y = batch(step)
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(x, step), y).backward()
        if step % 2 == 1:
            assert model.extra.grad is None
        optimizer.step()
        skipped.append(optimizer.last_step[0].skipped)
        norms.append(optimizer.last_step[0].grad_norm)
    optimizer.close()
    assert skipped == [False] * NAN_STEP + [True]
    assert max(norms[:NAN_STEP]) > MAX_GRAD_NORM


def test_corrupt_state_on_one_rank_fails_every_rank(nvme_dir):
    spawn(2, nvme_dir, "fault")
    errors = [open(os.path.join(nvme_dir, f"error{rank}.txt")).read() for rank in range(2)]
    assert errors[1].startswith("Corruption"), errors[1]
    assert "rank(s) 1 failed the step" in errors[0], errors[0]


def trained_unclosed_optimizer(stage, nvme_dir):
    """A sharded optimizer on the default group after two steps, not closed."""
    model = Net()
    optimizer = make_optimizer("AdamW", model.parameters(), os.path.join(nvme_dir, "nvme-{rank}"),
                               buffer_count=2, process_group=dist.group.WORLD, zero_stage=stage)
    train(optimizer, model, 0, 1, steps=2)
    return optimizer


@pytest.mark.parametrize("stage", [1, 2])
def test_unreferenced_optimizer_leaves_with_its_process_group(nvme_dir, stage):
    """As a rank leaving on a failed step does: an optimizer neither closed nor referenced any
    more is freed by its references alone (no cycle waits for a garbage collection), and
    destroy_process_group() then ends the group. A group kept alive into interpreter shutdown
    has gloo workers that abort the process when they release a finished collective's tensor
    there."""
    gc.disable()  # references only, as between a rank's last step and its exit
    try:
        dist.init_process_group("gloo", init_method=f"file://{nvme_dir}/init", rank=0,
                                world_size=1)
        try:
            group = weakref.ref(dist.group.WORLD)
            optimizer = weakref.ref(trained_unclosed_optimizer(stage, nvme_dir))
            assert optimizer() is None, "the unreferenced optimizer is still alive"
        finally:
            dist.destroy_process_group()
        assert group() is None, "destroy_process_group() left the process group alive"
    finally:
        gc.enable()


@pytest.mark.parametrize("stage", [1, 2])
def test_live_optimizer_does_not_keep_a_destroyed_process_group(nvme_dir, stage):
    """An optimizer still referenced does not keep its group past destroy_process_group(); a
    step afterwards raises FailedPrecondition naming it."""
    dist.init_process_group("gloo", init_method=f"file://{nvme_dir}/init", rank=0, world_size=1)
    try:
        group = weakref.ref(dist.group.WORLD)
        optimizer = trained_unclosed_optimizer(stage, nvme_dir)
    finally:
        dist.destroy_process_group()
    try:
        assert group() is None, "the optimizer kept the destroyed process group alive"
        model_params = [p for g in optimizer.param_groups for p in g["params"]]
        for param in model_params:
            param.grad = torch.ones_like(param)
        with pytest.raises(zoe.FailedPrecondition, match="destroy_process_group"):
            optimizer.step()
    finally:
        optimizer.close()


def test_checkpoint_of_another_layout_is_refused(nvme_dir):
    dist.init_process_group("gloo", init_method=f"file://{nvme_dir}/init", rank=0, world_size=1)
    try:
        optimizer = zoe.torch.AdamW(Net().parameters(), process_group=dist.group.WORLD,
                                    zero_stage=1)
        with pytest.raises(zoe.NotFound, match="holds no sharded zoe checkpoint"):
            optimizer.load_checkpoint(os.path.join(nvme_dir, "none"))
        with open(os.path.join(nvme_dir, "zoe_sharded_manifest.json"), "w") as file:
            file.write('{"world_size": 2, "groups": [{"name": "zoe.0", "count": 1285}]}')
        with pytest.raises(zoe.FailedPrecondition, match="is of 2 ranks"):
            optimizer.load_checkpoint(nvme_dir)
        optimizer.close()
    finally:
        dist.destroy_process_group()


def test_stage_out_of_range_is_refused(nvme_dir):
    with pytest.raises(zoe.InvalidArgument, match="zero_stage = 0 is not allowed"):
        if not dist.is_initialized():
            dist.init_process_group("gloo", init_method=f"file://{nvme_dir}/init", rank=0,
                                    world_size=1)
        try:
            zoe.torch.AdamW(Net().parameters(), process_group=dist.group.WORLD, zero_stage=0)
        finally:
            dist.destroy_process_group()


def test_a_failed_step_on_one_rank_leaves_its_parameters_alone(nvme_dir):
    """One rank (its whole group is its shard): a step that finds its state corrupted on disk
    raises, and the parameters are as before it -- zoe writes them only once the step succeeded,
    as it does with several ranks."""
    from test_device_waits import one_rank_group

    with one_rank_group() as group:
        model = Net()
        nvme = os.path.join(nvme_dir, "state")
        optimizer = make_optimizer("AdamW", model.parameters(), nvme, buffer_count=2,
                                   process_group=group, zero_stage=2)
        train(optimizer, model, 0, 1, steps=2)
        before = [p.detach().clone() for p in model.parameters()]
        for path in glob.glob(os.path.join(nvme, "zoe-optimizer-*")):
            size = os.path.getsize(path)
            with open(path, "r+b") as file:
                file.seek(size // 2)
                file.write(b"\xa5" * (size - size // 2))
        with pytest.raises(zoe.Corruption):
            train(optimizer, model, 0, 1, steps=1, first=2)
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        optimizer.close()
