"""zoe.torch.initialize on 2 ranks (torch.multiprocessing, gloo): the DeepSpeed-style script at
ZeRO stage 0 (the engine all-reduces the gradients), 1 and 2 (zoe's sharded optimizer; stage 2
with gradient accumulation) and 3 (parameters sharded and paged from NVMe) with the optimizer
state in DRAM or on NVMe, checkpoint and fresh
engine half-way, ends on every rank with the parameters of one process running the plain torch
loop over the whole batch; an fp16 overflow on one rank only skips the step on both (stages 0
and 2)."""

import datetime
import os
import traceback

import pytest
import torch
import torch.distributed as dist

import zoe.torch
from conftest import spawn_ranks
from initialize_script import assert_same_state, ds_config, reference, run_script
from test_initialize_fp16 import EXPECTED_SCALES, OVERFLOW_STEPS, HalfNet, fp16_config, \
    run_fp16_steps

WORLD = 2
JOIN_SECONDS = 50
FP16_STAGES = (0, 2)
RUNS = [(0, "none", None), (1, "cpu", None), (2, "nvme", None), (3, "nvme", "nvme")]


def run_scripts(rank, out_dir):
    for stage, offload, offload_param in RUNS:
        config = ds_config(stage, offload, os.path.join(out_dir, f"swap{stage}"), WORLD,
                           offload_param)
        state = run_script(config, os.path.join(out_dir, f"ckpt{stage}"), rank, WORLD)
        torch.save(state, os.path.join(out_dir, f"stage{stage}-rank{rank}.pt"))


def run_fp16(rank, out_dir, stage):
    """Rank 1 alone overflows on OVERFLOW_STEPS."""
    config = fp16_config()
    config["train_batch_size"] = 4 * 2 * WORLD
    config["zero_optimization"]["stage"] = stage
    engine, _, _, _ = zoe.torch.initialize(model=HalfNet(), config=config)
    overflows = OVERFLOW_STEPS if rank == 1 else ()
    scales, before, after = run_fp16_steps(engine, len(EXPECTED_SCALES), overflows)
    unchanged = [all(torch.equal(a, b) for a, b in zip(before[step], after[step]))
                 for step in range(len(EXPECTED_SCALES))]
    torch.save({"scales": scales, "skipped": engine.skipped_steps, "params": after[-1],
                "unchanged": unchanged},
               os.path.join(out_dir, f"fp16-stage{stage}-rank{rank}.pt"))
    engine.close()


def worker(rank, out_dir):
    try:
        dist.init_process_group("gloo", init_method=f"file://{out_dir}/init", rank=rank,
                                world_size=WORLD, timeout=datetime.timedelta(seconds=30))
        run_scripts(rank, out_dir)
        for stage in FP16_STAGES:
            run_fp16(rank, out_dir, stage)
    except BaseException:
        with open(os.path.join(out_dir, f"crash{rank}.txt"), "w") as file:
            file.write(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(out_dir):
    spawn_ranks(worker, (out_dir,), WORLD, out_dir, JOIN_SECONDS)


def test_two_ranks_equal_one_process(nvme_dir):
    spawn(nvme_dir)
    expected = reference(WORLD)
    for stage, _, _ in RUNS:
        for rank in range(WORLD):
            found = torch.load(os.path.join(nvme_dir, f"stage{stage}-rank{rank}.pt"))
            assert_same_state(found, expected)
    for stage in FP16_STAGES:
        results = [torch.load(os.path.join(nvme_dir, f"fp16-stage{stage}-rank{rank}.pt"))
                   for rank in range(WORLD)]
        for result in results:
            assert result["scales"] == EXPECTED_SCALES
            assert result["skipped"] == len(OVERFLOW_STEPS)
            assert result["unchanged"] == [step in OVERFLOW_STEPS
                                           for step in range(len(EXPECTED_SCALES))]
        for first, second in zip(results[0]["params"], results[1]["params"]):
            assert torch.equal(first, second)
