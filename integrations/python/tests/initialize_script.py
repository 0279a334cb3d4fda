"""Shared by the test_initialize*.py files: a DeepSpeed-style training script run through
zoe.torch.initialize (gradient accumulation 2, clipping 1.0, AdamW -- or Adagrad or Lion -- and
WarmupLR from the config, a save_checkpoint and a load_checkpoint into a fresh engine half-way)
and the equivalent plain torch loop in one process."""

import copy

import torch

import zoe.torch
from lion_reference import ReferenceLion
from zoe.torch.lr_schedules import WarmupLR

STEPS = 6            # optimizer steps
ACCUMULATION = 2
MICRO = 4            # samples per rank per micro-batch
LR = 0.01
WEIGHT_DECAY = 0.01
CLIP = 1.0
WARMUP = dict(warmup_min_lr=0.0, warmup_max_lr=LR, warmup_num_steps=4)
# Per optimizer type: the config's params, and the reference optimizer over those params
OPTIMIZERS = {
    "AdamW": (dict(lr=LR, betas=[0.9, 0.999], eps=1e-8, weight_decay=WEIGHT_DECAY),
              torch.optim.AdamW),
    "Adagrad": (dict(lr=LR, eps=1e-10, weight_decay=WEIGHT_DECAY), torch.optim.Adagrad),
    "Lion": (dict(lr=LR / 10, betas=[0.9, 0.99], weight_decay=WEIGHT_DECAY), ReferenceLion),
}


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def ds_config(stage=0, offload="none", nvme_path=None, world=1, offload_param=None,
              optimizer="AdamW"):
    """The DeepSpeed configuration the scripts train with (``offload_param``: stage 3's;
    ``optimizer``: a type of OPTIMIZERS)."""
    offload_section = {"device": offload}
    if offload == "nvme":
        offload_section["nvme_path"] = nvme_path
    zero = {"stage": stage, "offload_optimizer": offload_section, "sub_group_size": 64}
    if offload_param is not None:
        zero["offload_param"] = {"device": offload_param}
        if offload_param == "nvme":
            zero["offload_param"]["nvme_path"] = nvme_path
    return {
        "train_batch_size": MICRO * ACCUMULATION * world,
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": CLIP,
        "optimizer": {"type": optimizer, "params": dict(OPTIMIZERS[optimizer][0])},
        "scheduler": {"type": "WarmupLR",
                      "params": dict(WARMUP, warmup_max_lr=OPTIMIZERS[optimizer][0]["lr"])},
        "zero_optimization": zero,
        "zoe": {"device": "host", "chunk_size": "64K", "host_budget": "64M",
                "tensor_swap_bytes": "1M", "log_level": "error"},
    }


def micro_batch(step, micro, world):
    """The global micro-batch ``micro`` of optimizer step ``step``: MICRO rows per rank.
    Large inputs at step 1 make the gradient norm exceed CLIP, so clipping acts."""
    generator = torch.Generator().manual_seed(1000 * step + micro)
    x = torch.randn(MICRO * world, 8, generator=generator) * (20.0 if step == 1 else 1.0)
    y = torch.randn(MICRO * world, 4, generator=generator)
    return x, y


def rows(tensor, rank, world):
    return tensor[rank * MICRO:(rank + 1) * MICRO]


def train_engine(engine, first, last, rank, world):
    """Optimizer steps [first, last) as a DeepSpeed script writes them."""
    for step in range(first, last):
        for micro in range(ACCUMULATION):
            x, y = micro_batch(step, micro, world)
            loss = torch.nn.functional.mse_loss(engine(rows(x, rank, world)), rows(y, rank, world))
            engine.backward(loss)
            engine.step()


def accelerate_steps(engine, first, last, rank=0, world=1):
    """Optimizer steps [first, last) as accelerate drives DeepSpeed (its
    DeepSpeedEngineWrapper.backward): set_gradient_accumulation_boundary before every
    backward, step() after the boundary's only. Returns, per micro-batch, (whether the
    parameters changed in it, whether they should: a boundary with a learning rate)."""
    changes = []
    for step in range(first, last):
        for micro in range(ACCUMULATION):
            before = module_values(engine)
            boundary = micro == ACCUMULATION - 1
            moves = boundary and engine.get_lr()[0] > 0  # WarmupLR's rate starts at 0
            engine.set_gradient_accumulation_boundary(boundary)
            x, y = micro_batch(step, micro, world)
            engine.backward(torch.nn.functional.mse_loss(engine(rows(x, rank, world)),
                                                         rows(y, rank, world)))
            if boundary:
                engine.step()
            changed = any(not torch.equal(before[key], value)
                          for key, value in engine.module_state_dict().items())
            changes.append((changed, moves))
    return changes


def module_values(engine):
    """Copies of the engine's module_state_dict() values."""
    return {key: value.clone() for key, value in engine.module_state_dict().items()}


def run_script(config, checkpoint_dir, rank=0, world=1):
    """The DeepSpeed-style script: half the steps, save, a fresh engine loads and finishes.
    Returns the final module_state_dict and the learning rates each engine reported."""
    model = make_model()
    engine, _, _, _ = zoe.torch.initialize(model=model, model_parameters=model.parameters(),
                                           config=config)
    train_engine(engine, 0, STEPS // 2, rank, world)
    engine.save_checkpoint(checkpoint_dir, client_state={"epoch": 3})
    engine.close()
    model = make_model(seed=1)  # different values: the checkpoint must restore them
    engine, _, _, scheduler = zoe.torch.initialize(model=model, config=config)
    path, client = engine.load_checkpoint(checkpoint_dir)
    assert client == {"epoch": 3} and path.endswith(f"global_step{STEPS // 2}"), (path, client)
    assert engine.global_steps == STEPS // 2 and engine.micro_steps == STEPS
    assert scheduler.last_batch_iteration == STEPS // 2 - 1
    train_engine(engine, STEPS // 2, STEPS, rank, world)
    state = {key: value.clone() for key, value in engine.module_state_dict().items()}
    engine.close()
    return state


def torch_loop(model, optimizer="AdamW"):
    """(optimizer, schedule) of the plain torch loop over ``model``: the optimizer of type
    ``optimizer`` (a type of OPTIMIZERS) with the config's params, WarmupLR."""
    params, reference_class = OPTIMIZERS[optimizer]
    params = dict(params, betas=tuple(params["betas"])) if "betas" in params else params
    torch_optimizer = reference_class(model.parameters(), **params)
    return torch_optimizer, WarmupLR(torch_optimizer, **dict(WARMUP, warmup_max_lr=params["lr"]))


def grouped_torch_adamw(model):
    """As Hugging Face's Trainer builds one for DeepSpeed when the config names no optimizer:
    torch's AdamW over weights (decayed) and biases (not), with a linear warmup LambdaLR."""
    weights = [param for param in model.parameters() if param.dim() > 1]
    biases = [param for param in model.parameters() if param.dim() <= 1]
    optimizer = torch.optim.AdamW([{"params": weights, "weight_decay": WEIGHT_DECAY},
                                   {"params": biases, "weight_decay": 0.0}], lr=LR)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 3))
    return optimizer, schedule


def torch_steps(model, optimizer, schedule, first, last, world=1):
    """Optimizer steps [first, last) of the plain torch loop over the whole batch: loss /
    accumulation, clip_grad_norm_, the optimizer, the schedule stepped after each step."""
    for step in range(first, last):
        for micro in range(ACCUMULATION):
            x, y = micro_batch(step, micro, world)
            (torch.nn.functional.mse_loss(model(x), y) / ACCUMULATION).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)


def reference(world=1, optimizer="AdamW", steps=STEPS):
    """The parameters the script must end with after ``steps`` steps: the plain torch loop
    (torch_loop, torch_steps) from make_model()."""
    model = make_model()
    torch_steps(model, *torch_loop(model, optimizer), 0, steps, world)
    return copy.deepcopy(model.state_dict())


def assert_same_state(found, expected, atol=2e-6):
    assert found.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(found[key], expected[key], rtol=1e-5, atol=atol,
                                   msg=lambda text, key=key: f"{key}: {text}")
