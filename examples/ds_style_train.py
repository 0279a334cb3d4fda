#!/usr/bin/python3
"""A training script written as DeepSpeed's documentation writes one (deepspeed.initialize, then
engine(x), engine.backward(loss), engine.step(), engine.save_checkpoint), running with zoe: the
only change from a DeepSpeed script is ``zoe.torch.initialize`` in place of
``deepspeed.initialize``. A small regression network trains on a synthetic data set with the
DeepSpeed configuration below (ZeRO stage 2, AdamW, WarmupLR, gradient accumulation 2, clipping
1.0, the optimizer state on NVMe), saves a checkpoint half-way, loads it into a fresh engine and
finishes.

One process by default; ``--ranks N`` starts N ranks with torch.multiprocessing on this machine,
talking over gloo (no torchrun needed), or run it under torchrun / with the usual environment
variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) set.

Usage: ds_style_train.py [--ranks N] [--stage 0|1|2|3] [--epochs N] [--deepspeed_config FILE]
                         [--work-dir DIR]
"""

import argparse
import datetime
import json
import os
import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import zoe.torch

DS_CONFIG = {
    "train_batch_size": "auto",  # derived: micro x accumulation x ranks
    "train_micro_batch_size_per_gpu": 16,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW",
                  "params": {"lr": 3e-3, "betas": [0.9, 0.999], "eps": 1e-8,
                             "weight_decay": 0.01}},
    "scheduler": {"type": "WarmupLR",
                  "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-3,
                             "warmup_num_steps": 20}},
    "zero_optimization": {"stage": 2,
                          "offload_optimizer": {"device": "nvme",
                                                "nvme_path": "WORK_DIR/nvme"}},
    "zoe": {"log_level": "warn"},
}


def parse_arguments():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local_rank", type=int, default=-1, help="set by launchers")
    parser.add_argument("--deepspeed_config", help="a DeepSpeed JSON configuration")
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--stage", type=int, choices=(0, 1, 2, 3))
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--work-dir", help="NVMe swap and checkpoints (default: a temporary "
                                           "directory, removed at the end)")
    return parser.parse_args()


def synthetic_data(samples=1024, seed=0):
    """y = sin(x A) B + noise: a data set every rank builds identically."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 32, generator=generator)
    a, b = torch.randn(32, 64, generator=generator), torch.randn(64, 8, generator=generator)
    y = torch.sin(x @ a) @ b / 8 + 0.01 * torch.randn(samples, 8, generator=generator)
    return torch.utils.data.TensorDataset(x, y)


def make_net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(),
                               torch.nn.Linear(128, 128), torch.nn.GELU(),
                               torch.nn.Linear(128, 8))


def train_epochs(engine, loader, epochs, first_epoch, rank):
    """The DeepSpeed loop: forward, backward and step on every micro-batch. The loader
    shuffles as DeepSpeed's, one order until its sampler is given the epoch."""
    for epoch in range(first_epoch, epochs):
        loader.data_sampler.set_epoch(epoch)
        total, count = 0.0, 0
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            total, count = total + loss.item(), count + 1
        if rank == 0:
            print(f"epoch {epoch}: mean loss {total / count:.5f}, step {engine.global_steps}, "
                  f"lr {engine.get_lr()[0]:.2e}", flush=True)


def run(args, checkpoint_dir, rank):
    """Half the epochs, a checkpoint, a fresh engine that loads it and trains on."""
    data = synthetic_data()
    net = make_net()
    engine, _, loader, _ = zoe.torch.initialize(args=args, model=net,
                                                model_parameters=net.parameters(),
                                                training_data=data)
    half = args.epochs // 2
    train_epochs(engine, loader, half, 0, rank)
    engine.save_checkpoint(checkpoint_dir, client_state={"epoch": half})
    engine.close()

    net = make_net()
    engine, _, loader, _ = zoe.torch.initialize(args=args, model=net, training_data=data)
    path, client_state = engine.load_checkpoint(checkpoint_dir)
    if rank == 0:
        print(f"resumed from {path} at epoch {client_state['epoch']}", flush=True)
    train_epochs(engine, loader, args.epochs, client_state["epoch"], rank)
    engine.close()


def with_config_file(args, work_dir):
    """``args`` with deepspeed_config set: the file given, else DS_CONFIG (with --stage)
    written to the work directory."""
    if args.deepspeed_config:
        return args
    config = json.loads(json.dumps(DS_CONFIG).replace("WORK_DIR", work_dir))
    if args.stage is not None:
        config["zero_optimization"]["stage"] = args.stage
    if args.stage == 3:  # the parameters too, paged from NVMe and sharded over the ranks
        config["zero_optimization"]["offload_param"] = {"device": "nvme",
                                                        "nvme_path": f"{work_dir}/nvme"}
    path = os.path.join(work_dir, f"ds_config-{os.getpid()}.json")
    with open(path, "w", encoding="utf-8") as file:
        json.dump(config, file, indent=2)
    return argparse.Namespace(**{**vars(args), "deepspeed_config": path})


def rank_main(rank, world, args, work_dir):
    """One of ``world`` ranks started by --ranks."""
    dist.init_process_group("gloo", init_method=f"file://{work_dir}/rendezvous", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        run(with_config_file(args, work_dir), os.path.join(work_dir, "checkpoints"), rank)
    finally:
        dist.destroy_process_group()


def main():
    args = parse_arguments()
    if "WORLD_SIZE" in os.environ and not args.work_dir:
        raise SystemExit("under torchrun, give --work-dir: a directory every rank shares")
    work_dir = args.work_dir or tempfile.mkdtemp(prefix="zoe-ds-example-")
    try:
        if args.ranks > 1:
            mp.start_processes(rank_main, args=(args.ranks, args, work_dir),
                               nprocs=args.ranks, start_method="spawn")
            return
        if "WORLD_SIZE" in os.environ:  # started by torchrun or by hand with the variables
            dist.init_process_group("gloo")
        rank = dist.get_rank() if dist.is_initialized() else 0
        run(with_config_file(args, work_dir), os.path.join(work_dir, "checkpoints"), rank)
    finally:
        if not args.work_dir:
            shutil.rmtree(work_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
