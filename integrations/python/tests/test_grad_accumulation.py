"""data_types.grad_accum_dtype "fp32" with a bf16 model at ZeRO stages 0 to 2: the micro-batches
of a step add up in fp32 sums (grad_accumulation.py), on every path that reads the gradients --
one process's host step, the device path (the CPU twin), stage 0's average over ranks, and the
sharded reductions of stages 1 and 2 -- where .grad in bf16 loses what is below its precision.

The model is one bias-free linear layer whose gradient is its input: the first micro-batch's is
2^-3 per element (after the engine's division by the 8 micro-batches), each of the seven others'
2^-12, below half a bf16 unit at 2^-3. In bf16 the sum stays 2^-3; in fp32 it is
2^-3 + 7 * 2^-12, which the step's gradient norm shows exactly."""

import math

import pytest
import torch

import zoe
import zoe.torch
from conftest import gloo_rank, spawn_ranks
from zoe.torch.device import HostTwin

ACCUMULATION = 8
FEATURES = 4
ELEMENTS = 2 * FEATURES  # the weight's
FP32_SUM = 2.0 ** -3 + 7 * 2.0 ** -12
BF16_SUM = 2.0 ** -3
WORLD = 2
JOIN_SECONDS = 180


def config(stage, world=1, accumulate_in=None, offload="cpu"):
    document = {
        "train_batch_size": ACCUMULATION * world,
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}},
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": stage, "offload_optimizer": {"device": offload}},
        "zoe": {"device": "host", "chunk_size": "64K", "host_budget": "64M",
                "tensor_swap_bytes": "1M", "log_level": "error"},
    }
    if accumulate_in is not None:
        document["data_types"] = {"grad_accum_dtype": accumulate_in}
    return document


def model():
    torch.manual_seed(0)
    return torch.nn.Linear(FEATURES, 2, bias=False)


def micro_input(micro):
    """The micro-batch's input: its gradient, times the number of micro-batches."""
    return torch.full((1, FEATURES), 1.0 if micro == 0 else 2.0 ** -9, dtype=torch.bfloat16)


def step_norm(engine):
    """One step of ACCUMULATION micro-batches; the gradient norm the optimizer stepped on."""
    for micro in range(ACCUMULATION):
        engine.backward(engine(micro_input(micro)).float().sum())
        engine.step()
    assert engine.global_steps >= 1
    return engine.get_global_grad_norm()


def expected_norm(per_element):
    return math.sqrt(ELEMENTS) * per_element


@pytest.mark.parametrize("stage, offload", [(0, "cpu"), (1, "cpu"), (2, "nvme")])
def test_fp32_accumulation_keeps_what_bf16_loses(nvme_dir, stage, offload):
    document = config(stage, accumulate_in="fp32", offload=offload)
    if offload == "nvme":
        document["zero_optimization"]["offload_optimizer"]["nvme_path"] = nvme_dir
    engine, optimizer, _, _ = zoe.torch.initialize(model=model(), config=document)
    assert optimizer.accumulation.dtype == torch.float32
    for _ in range(2):  # the sums start afresh after each step
        assert step_norm(engine) == pytest.approx(expected_norm(FP32_SUM), rel=1e-6)
    engine.close()


def test_without_it_micro_batches_add_up_in_bf16():
    """The model's dtype, in .grad, as DeepSpeed by default: what the test above keeps is lost
    (so that test fails where the sums are not fp32)."""
    engine, optimizer, _, _ = zoe.torch.initialize(model=model(), config=config(1))
    assert optimizer.accumulation.dtype is None
    assert step_norm(engine) == pytest.approx(expected_norm(BF16_SUM), rel=1e-6)
    engine.close()


def test_the_device_path_stages_fp32_gradients():
    """A zoe optimizer on the (adversarial) CPU twin: the boundary's gradient is copied to the
    host from its fp32 sum, through fp32 staging, as backward makes it final."""
    net = model().to(torch.bfloat16)
    optimizer = zoe.torch.AdamW(net.parameters(), lr=1e-3, weight_decay=0.0,
                                device_backend=HostTwin(adversarial=True),
                                grad_accum_dtype=torch.float32)
    document = config(0, accumulate_in="fp32")
    del document["optimizer"]
    engine, _, _, _ = zoe.torch.initialize(model=net, optimizer=optimizer, config=document)
    assert step_norm(engine) == pytest.approx(expected_norm(FP32_SUM), rel=1e-6)
    handed = optimizer._groups[0].device.stats
    assert handed["handed_in_backward"] + handed["handed_at_step"] == 1  # by the device group
    engine.close()
    optimizer.close()


def test_fp32_accumulation_trains_as_the_fp32_reference():
    """Random micro-batches, three steps: the module equals a torch loop that sums each
    micro-batch's bf16 gradient in fp32 and steps an fp32 master copy of the bf16 model (as zoe
    and DeepSpeed make theirs) with torch's AdamW."""
    steps, lr = 3, 1e-2
    engine, _, _, _ = zoe.torch.initialize(model=model(), config=dict(
        config(1, accumulate_in="fp32"),
        optimizer={"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.0}}))
    master = model()
    master.weight.data = master.weight.data.bfloat16().float()  # as zoe's master starts
    reference = torch.optim.AdamW(master.parameters(), lr=lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(5)
    for _ in range(steps):
        sums = torch.zeros_like(master.weight)
        for _ in range(ACCUMULATION):
            x = torch.randn(1, FEATURES, generator=generator).bfloat16()
            engine.backward(engine(x).float().square().sum())
            engine.step()
            twin = model().to(torch.bfloat16)
            twin.weight.data.copy_(master.weight.detach())
            (twin(x).float().square().sum() / ACCUMULATION).backward()
            sums += twin.weight.grad.float()
        master.weight.grad = sums
        reference.step()
    found = engine.module_state_dict()["weight"]
    assert found.dtype == torch.bfloat16
    torch.testing.assert_close(found, master.weight.detach().bfloat16(), rtol=0, atol=0)
    engine.close()


def ranks_keep_fp32(rank, stage, out_dir):
    with gloo_rank(rank, WORLD, f"{out_dir}/init", out_dir):
        engine, _, _, _ = zoe.torch.initialize(model=model(),
                                               config=config(stage, WORLD, accumulate_in="fp32"))
        for _ in range(2):  # every rank the same inputs: the mean is one rank's gradient
            norm = step_norm(engine)
            assert norm == pytest.approx(expected_norm(FP32_SUM), rel=1e-6), (stage, norm)
        engine.close()


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_fp32_accumulation_over_two_ranks(tmp_path, stage):
    """Stage 0's average over the ranks keeps the fp32 sums; stages 1 and 2 reduce them (stage
    2's buckets during the boundary's backward)."""
    spawn_ranks(ranks_keep_fp32, (stage, str(tmp_path)), WORLD, str(tmp_path), JOIN_SECONDS)


@pytest.mark.parametrize("stage, accumulate_in, message", [
    (1, "fp16", r"data_types.grad_accum_dtype = 'fp16' is not allowed: at "
                r"zero_optimization.stage 1 zoe accumulates .* in param.grad, in the model's "
                r"dtype, or in fp32; set it to \"bf16\" or \"fp32\", or remove it"),
    (3, "bf16", r"data_types.grad_accum_dtype = 'bf16' is not allowed: at "
                r"zero_optimization.stage 3 .* in the optimizer's gradient stores; set it to "
                r"\"fp32\", or remove it"),
])
def test_other_dtypes_are_refused(stage, accumulate_in, message):
    with pytest.raises(zoe.InvalidArgument, match=message):
        zoe.torch.initialize(model=model(), config=config(stage, accumulate_in=accumulate_in))


def test_a_torch_optimizer_torch_steps_is_refused():
    document = config(0, accumulate_in="fp32", offload="none")
    del document["optimizer"]
    net = model()
    with pytest.raises(zoe.InvalidArgument, match="needs zoe's optimizer, which keeps fp32 sums"):
        zoe.torch.initialize(model=net, optimizer=torch.optim.AdamW(net.parameters()),
                             config=document)


def test_a_zoe_optimizer_that_accumulates_otherwise_is_refused():
    net = model().to(torch.bfloat16)
    optimizer = zoe.torch.AdamW(net.parameters(), lr=1e-3)
    document = config(0, accumulate_in="fp32")
    del document["optimizer"]
    with pytest.raises(zoe.InvalidArgument, match=r"adds micro-batches up in .grad, in the "
                                                  r"model's dtype but the config's .* in fp32; "
                                                  r"construct it with "
                                                  r"grad_accum_dtype=torch.float32"):
        zoe.torch.initialize(model=net, optimizer=optimizer, config=document)
    optimizer.close()


def test_a_dtype_other_than_fp32_is_refused_by_the_optimizer():
    with pytest.raises(zoe.InvalidArgument, match="grad_accum_dtype = torch.float16 is not "
                                                  "allowed; allowed: None .* or torch.float32"):
        zoe.torch.AdamW(model().parameters(), offload="cpu", grad_accum_dtype=torch.float16)
