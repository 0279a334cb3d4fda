"""zoe.torch.initialize on 2 and 3 ranks (torch.multiprocessing, gloo): the DeepSpeed-style script
at ZeRO stage 0 (the engine all-reduces the gradients, 2 ranks), 1 and 2 (zoe's sharded optimizer;
stage 2 with gradient accumulation) and 3 (parameters sharded and paged from NVMe) with the
optimizer state in DRAM or on NVMe, AdamW (Adagrad and Lion at some stages), checkpoint and fresh
engine half-way, ends on every rank with the parameters of one process running the plain torch loop
over the whole batch; on 2 ranks an fp16 overflow on one rank only skips the step on both (stages
0, 2 and 3), the loss scale follows DeepSpeed's rule on both and stage 3 trains as stage 0; at
stage 0 a model on the CPU twin steps the averaged gradients (none handed to zoe in backward);
save_16bit_model at stage 3 writes the parameters every rank gathers."""

import os

import pytest
import torch
import torch.distributed as dist

import zoe.torch
from conftest import gloo_rank, spawn_ranks
from zoe.torch.device import HostTwin
from initialize_script import CLIP, LR, STEPS, WEIGHT_DECAY, assert_same_state, ds_config, \
    grouped_torch_adamw, make_model, reference, run_script, torch_steps, train_engine
from test_initialize_fp16 import EXPECTED_SCALES, OVERFLOW_STEPS, HalfNet, expected_scales, \
    fp16_config, run_fp16_steps_read

JOIN_SECONDS = 50
FP16_WORLD = 2
FP16_STAGES = (0, 2, 3)
# (stage, offload_optimizer, offload_param, the config's optimizer type): on 2 ranks every stage
# with every offload (stage 3's parameters offloaded as its optimizer state), AdamW, and Lion and
# Adagrad at one stage each; on 3 ranks stages 1 to 3.
RUNS = {2: [(stage, offload, offload if stage == 3 else None, "AdamW")
            for stage in range(4) for offload in ("none", "cpu", "nvme")]
        + [(2, "cpu", None, "Lion"), (3, "cpu", "cpu", "Adagrad")],
        3: [(1, "cpu", None, "AdamW"), (2, "nvme", None, "AdamW"), (3, "cpu", "cpu", "AdamW"),
            (1, "nvme", None, "Adagrad"), (3, "cpu", "cpu", "Lion")]}


def run_name(stage, offload, optimizer):
    return f"{stage}-{offload}-{optimizer}"


def run_scripts(rank, out_dir, world):
    for stage, offload, offload_param, optimizer in RUNS[world]:
        name = run_name(stage, offload, optimizer)
        config = ds_config(stage, offload, os.path.join(out_dir, f"swap{name}"), world,
                           offload_param, optimizer)
        state = run_script(config, os.path.join(out_dir, f"ckpt{name}"), rank, world)
        torch.save(state, os.path.join(out_dir, f"stage{name}-rank{rank}.pt"))


TWIN_STAGES = (0, 1, 2)


def run_twin(rank, out_dir, world):
    """Stages 0 to 2 with a user's zoe AdamW over a model on the (adversarial) CPU twin. At stage
    0 the engine averages the gradients after backward, so zoe must not take them during it; at
    stages 1 and 2 the optimizer reduces them on the device and steps its shard
    (zero_places.DevicePlace)."""
    for stage in TWIN_STAGES:
        config = ds_config(stage, world=world)
        del config["optimizer"]
        model = make_model()
        sharding = {} if stage == 0 else {"process_group": dist.group.WORLD, "zero_stage": stage}
        optimizer = zoe.torch.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY,
                                    max_grad_norm=CLIP, device_backend=HostTwin(adversarial=True),
                                    **sharding)
        engine, _, _, _ = zoe.torch.initialize(model=model, optimizer=optimizer, config=config)
        train_engine(engine, 0, STEPS, rank, world)
        device = optimizer._groups[0].device
        torch.save({"state": engine.module_state_dict(),
                    "handed": None if device is None else dict(device.stats)},
                   os.path.join(out_dir, f"twin{stage}-rank{rank}.pt"))
        engine.close()
        optimizer.close()


TORCH_OPTIMIZER_STAGES = (1, 2)


def run_torch_optimizer(rank, out_dir, world):
    """Stages 1 and 2 with a torch AdamW of two param groups and a schedule over it, as Hugging
    Face's Trainer passes them: zoe's sharded AdamW steps the same param groups."""
    for stage in TORCH_OPTIMIZER_STAGES:
        config = ds_config(stage, "cpu", world=world)
        del config["optimizer"], config["scheduler"]
        model = make_model()
        optimizer, schedule = grouped_torch_adamw(model)
        engine, _, _, _ = zoe.torch.initialize(model=model, optimizer=optimizer,
                                               lr_scheduler=schedule, config=config)
        train_engine(engine, 0, STEPS, rank, world)
        torch.save(engine.module_state_dict(),
                   os.path.join(out_dir, f"torch-optimizer{stage}-rank{rank}.pt"))
        engine.close()


def run_save_16bit(rank, out_dir, world):
    """Stage 3 over the ranks: save_16bit_model gathers the full parameters and rank 0 writes
    them; every rank keeps its gathered state to compare."""
    engine, _, _, _ = zoe.torch.initialize(model=make_model(),
                                           config=ds_config(3, "cpu", None, world, "cpu"))
    train_engine(engine, 0, 1, rank, world)
    engine.save_16bit_model(os.path.join(out_dir, "model16"))
    torch.save(engine.module_state_dict(), os.path.join(out_dir, f"model16-rank{rank}.pt"))
    engine.close()


def run_fp16(rank, out_dir, stage):
    """Rank 1 alone overflows on OVERFLOW_STEPS."""
    config = fp16_config()
    config["train_batch_size"] = 4 * 2 * FP16_WORLD
    config["zero_optimization"]["stage"] = stage
    engine, _, _, _ = zoe.torch.initialize(model=HalfNet(), config=config)
    overflows = OVERFLOW_STEPS if rank == 1 else ()
    scales, before, after = run_fp16_steps_read(engine, len(EXPECTED_SCALES), overflows)
    unchanged = [all(torch.equal(a, b) for a, b in zip(before[step], after[step]))
                 for step in range(len(EXPECTED_SCALES))]
    torch.save({"scales": scales, "skipped": engine.skipped_steps, "params": after[-1],
                "unchanged": unchanged},
               os.path.join(out_dir, f"fp16-stage{stage}-rank{rank}.pt"))
    engine.close()


# engine.stats() recorded at stages 2 and 3 (DRAM); at stage 3 also with DeepSpeed's
# stage3_max_live_parameters at 0 (nothing kept gathered from forward to backward)
STATS_RUNS = {"2": (2, None, {}), "3": (3, "cpu", {}),
              "3-keep-none": (3, "cpu", {"stage3_max_live_parameters": 0})}


def record_stats(rank, out_dir, world):
    """engine.stats() after two optimizer steps of each of STATS_RUNS."""
    for name, (stage, offload_param, zero) in STATS_RUNS.items():
        config = ds_config(stage, "cpu", None, world, offload_param)
        config["zero_optimization"].update(zero)
        engine, _, _, _ = zoe.torch.initialize(model=make_model(), config=config)
        train_engine(engine, 0, 2, rank, world)
        torch.save(engine.stats(), os.path.join(out_dir, f"stats{name}-rank{rank}.pt"))
        engine.close()


def worker(rank, out_dir, world):
    with gloo_rank(rank, world, f"{out_dir}/init", out_dir):
        run_scripts(rank, out_dir, world)
        if world == FP16_WORLD:
            run_twin(rank, out_dir, world)
            run_torch_optimizer(rank, out_dir, world)
            run_save_16bit(rank, out_dir, world)
            record_stats(rank, out_dir, world)
            for stage in FP16_STAGES:
                run_fp16(rank, out_dir, stage)


def check_consolidated(nvme_dir, world, name, optimizer):
    """The stage 3 save half-way of run ``name``, consolidated without the ranks: the parameters
    of the plain loop after those steps, and the optimizer's state under its kind's names."""
    saved = os.path.join(nvme_dir, f"ckpt{name}", f"global_step{STEPS // 2}", "optimizer")
    consolidated = zoe.torch.consolidated_state_dict(saved)
    assert_same_state(consolidated["model"], reference(world, optimizer, steps=STEPS // 2))
    moments = {"AdamW": ["exp_avg", "exp_avg_sq"], "Adagrad": ["sum"], "Lion": ["exp_avg"]}
    for entry in consolidated["optimizer"]["state"].values():
        assert sorted(entry) == sorted(["step"] + moments[optimizer])
        assert float(entry["step"]) == STEPS // 2


@pytest.mark.parametrize("world", sorted(RUNS))
def test_ranks_equal_one_process(nvme_dir, world):
    spawn_ranks(worker, (nvme_dir, world), world, nvme_dir, JOIN_SECONDS)
    for stage, offload, _, optimizer in RUNS[world]:
        expected = reference(world, optimizer)
        name = run_name(stage, offload, optimizer)
        for rank in range(world):
            found = torch.load(os.path.join(nvme_dir, f"stage{name}-rank{rank}.pt"))
            assert_same_state(found, expected)
        if stage == 3:
            check_consolidated(nvme_dir, world, name, optimizer)
    if world != FP16_WORLD:
        return
    saved = torch.load(os.path.join(nvme_dir, "model16", "pytorch_model.bin"))
    for rank in range(world):
        assert_same_state(torch.load(os.path.join(nvme_dir, f"model16-rank{rank}.pt")), saved,
                          atol=0)
    for rank in range(world):
        for stage in TWIN_STAGES:
            twin = torch.load(os.path.join(nvme_dir, f"twin{stage}-rank{rank}.pt"))
            assert_same_state(twin["state"], reference(world))
        twin = torch.load(os.path.join(nvme_dir, f"twin0-rank{rank}.pt"))
        assert twin["handed"]["handed_in_backward"] == 0 < twin["handed"]["handed_at_step"]
    model = make_model()
    torch_steps(model, *grouped_torch_adamw(model), 0, STEPS, world)
    for rank in range(world):
        for stage in TORCH_OPTIMIZER_STAGES:
            found = torch.load(os.path.join(nvme_dir, f"torch-optimizer{stage}-rank{rank}.pt"))
            assert_same_state(found, model.state_dict())
    for rank in range(world):
        stage2, stage3, keep_none = (
            torch.load(os.path.join(nvme_dir, f"stats{name}-rank{rank}.pt"))
            for name in STATS_RUNS)
        assert stage2["optimizer_collectives"] > 0 and stage2["gathers"] == 0.0
        assert stage3["gathers"] > 0 and stage3["reductions"] > 0
        assert stage3["optimizer_collectives"] == 0.0
        assert stage3["pager"]["reductions"]["issued"] > 0
        # DeepSpeed's default keeps the weights forward gathered for backward; 0 keeps none
        gathers, gathers_keeping_none = (
            sum(stats["pager"]["gathers"][key] for key in ("prefetched", "on_demand"))
            for stats in (stage3, keep_none))
        kept = stage3["pager"]["gathers"]["kept"]
        assert kept > 0 and keep_none["pager"]["gathers"]["kept"] == 0
        assert keep_none["pager"]["keep"]["max_live_parameters"] == 0
        assert gathers_keeping_none - gathers == kept
        for stats in (stage2, stage3):
            assert stats["forward"] > 0 and stats["backward"] > 0 and stats["step"] > 0
    by_stage = {}
    for stage in FP16_STAGES:
        results = [torch.load(os.path.join(nvme_dir, f"fp16-stage{stage}-rank{rank}.pt"))
                   for rank in range(world)]
        for result in results:
            assert result["scales"] == expected_scales(stage)
            assert result["skipped"] == len(OVERFLOW_STEPS)
            assert result["unchanged"] == [step in OVERFLOW_STEPS
                                           for step in range(len(EXPECTED_SCALES))]
        for first, second in zip(results[0]["params"], results[1]["params"]):
            assert torch.equal(first, second)
        by_stage[stage] = results[0]["params"]
    for found, wanted in zip(by_stage[3], by_stage[0]):
        assert found.dtype == torch.float16
        torch.testing.assert_close(found, wanted, rtol=0, atol=0)
