"""zoe.torch on a CUDA model (run where torch sees a GPU and libzoe.so was built with CUDA;
skipped elsewhere, so CI never needs one; scripts/gpu-kit.sh bundles and runs them):
zoe.torch.AdamW on a model on the GPU against torch's AdamW fed the same gradients on the CPU
(identical bits with torch 1.13 under EXACT_TORCH), overlapped and not, fp32 and bf16, state in
DRAM and on NVMe; against torch's AdamW on the GPU (within CUDA's rounding); offload_parameters
into the GPU's DEVICE tier, alone or beside parameters left in GPU memory in one param group;
a bf16 model paged there loads its optimizer's state dict."""

import copy

import pytest
import torch

import zoe
import zoe.torch
from conftest import EXACT_TORCH

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device visible to torch"
)

STEPS = 50
# zoe's kernels do torch 1.13's single-tensor AdamW arithmetic in its order (test_optim.py); the
# bits are demanded where that is the torch in use, else the comparison allows CPU rounding.
EXACT = EXACT_TORCH and torch.__version__.startswith("1.13")


def gpu_config(nvme_dir, offload="cpu", **zoe_options):
    section = {"device": offload}
    if offload == "nvme":
        section["nvme_path"] = nvme_dir
    options = {"device": "cuda", "chunk_size": "64K", "host_budget": "512M",
               "tensor_swap_bytes": "256M", "log_level": "warn"}
    options.update(zoe_options)
    return {"zero_optimization": {"stage": 3, "offload_optimizer": section}, "zoe": options}


@pytest.fixture(params=["cpu", "nvme"])
def engine(request, nvme_dir):
    with zoe.Engine(gpu_config(nvme_dir, offload=request.param)) as e:
        if not e.stats()["device"]["gpu"]:
            pytest.skip(f"libzoe.so has no CUDA device tier: {e.stats()['device']['backend']}")
        yield e


def make_model(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.LayerNorm(256),
        torch.nn.Linear(256, 16),
    ).to(dtype)


def batch(step, dtype, device):
    generator = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(32, 64, generator=generator).to(dtype)
    y = torch.randn(32, 16, generator=generator).to(dtype)
    return x.to(device), y.to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("overlapped", [True, False], ids=["overlap", "after"])
def test_cuda_model_matches_torch_adamw_fed_the_same_gradients(engine, dtype, overlapped):
    model = make_model(dtype).cuda()
    master = make_model(dtype).float()  # the reference's fp32 master weights, on the CPU
    torch_opt = torch.optim.AdamW(master.parameters(), lr=3e-3, weight_decay=0.1, foreach=False)
    zoe_opt = zoe.torch.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, engine=engine)
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + 0.05 * s))
                 for o in (torch_opt, zoe_opt)]
    for step in range(STEPS):
        zoe_opt.zero_grad(set_to_none=True)
        x, y = batch(step, dtype, "cuda")
        loss = torch.nn.functional.mse_loss(model(x).float(), y.float())
        if overlapped:
            with zoe_opt.overlap():
                loss.backward()
        else:
            loss.backward()
        for reference, param in zip(master.parameters(), model.parameters()):
            reference.grad = param.grad.float().cpu()
        zoe_opt.step()
        torch_opt.step()
        for scheduler in schedules:
            scheduler.step()
        for (name, reference), param in zip(master.named_parameters(), model.parameters()):
            expected = reference.detach().to(dtype)
            if EXACT:
                assert torch.equal(param.detach().cpu(), expected), (step, name)
            elif dtype == torch.float32:
                torch.testing.assert_close(param.detach().cpu(), expected, rtol=1e-5, atol=1e-6)
            else:  # a last-bit difference of the master can round to the next bf16
                torch.testing.assert_close(param.detach().cpu(), expected, rtol=2**-7, atol=1e-5)
    assert zoe_opt.last_step[0].steps_taken == STEPS
    zoe_opt.close()


@pytest.fixture
def nccl_group(nvme_dir):
    """A NCCL process group of this process alone (NCCL takes one rank per GPU)."""
    import torch.distributed as dist

    dist.init_process_group("nccl", init_method=f"file://{nvme_dir}/nccl-init", rank=0,
                            world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("stage", [1, 2])
def test_cuda_model_sharded_over_nccl_matches_torch_adamw(engine, nccl_group, dtype, stage):
    """ZeRO stages 1 and 2 with the model on the GPU (zero_places.DevicePlace): gradients
    reduced over NCCL on the device and copied to the host shard, the updated shard copied back
    and all-gathered on the device, against torch's AdamW fed the same gradients."""
    model = make_model(dtype).cuda()
    master = make_model(dtype).float()
    torch_opt = torch.optim.AdamW(master.parameters(), lr=3e-3, weight_decay=0.1, foreach=False)
    zoe_opt = zoe.torch.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, engine=engine,
                              process_group=nccl_group, zero_stage=stage, bucket_elements=4096)
    for step in range(10):
        zoe_opt.zero_grad(set_to_none=True)
        x, y = batch(step, dtype, "cuda")
        torch.nn.functional.mse_loss(model(x).float(), y.float()).backward()
        for reference, param in zip(master.parameters(), model.parameters()):
            reference.grad = param.grad.float().cpu()
        zoe_opt.step()
        torch_opt.step()
        for (name, reference), param in zip(master.named_parameters(), model.parameters()):
            tolerance = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(
                rtol=2**-7, atol=1e-5)
            torch.testing.assert_close(param.detach().cpu(), reference.detach().to(dtype),
                                       msg=f"step {step} {name}", **tolerance)
    assert zoe_opt._groups[0].device is None  # the sharded device path, not DeviceGroup
    zoe_opt.close()


def weight_and_bias_groups(model):
    return [{"params": [p for p in model.parameters() if p.dim() > 1]},
            {"params": [p for p in model.parameters() if p.dim() <= 1], "weight_decay": 0.0}]


@pytest.mark.parametrize("stage", [0, 2])
def test_cuda_groups_are_clipped_by_the_norm_of_both(engine, request, stage):
    """Two param groups of a CUDA model clipped by the norm of every gradient (global_clip.py):
    the device groups' sums of squares from zoe's scan of what was handed over, and over NCCL
    at stage 2; against torch's AdamW after clip_grad_norm_ over all the parameters."""
    sharding = {}
    if stage:
        sharding = dict(process_group=request.getfixturevalue("nccl_group"), zero_stage=stage,
                        bucket_elements=4096)
    model = make_model().cuda()
    master = make_model()
    torch_opt = torch.optim.AdamW(weight_and_bias_groups(master), lr=3e-3, weight_decay=0.1,
                                  foreach=False)
    zoe_opt = zoe.torch.AdamW(weight_and_bias_groups(model), lr=3e-3, weight_decay=0.1,
                              max_grad_norm=0.05, engine=engine, **sharding)
    for step in range(10):
        zoe_opt.zero_grad(set_to_none=True)
        x, y = batch(step, torch.float32, "cuda")
        torch.nn.functional.mse_loss(model(x), y).backward()
        for reference, param in zip(master.parameters(), model.parameters()):
            reference.grad = param.grad.cpu()
        zoe_opt.step()
        norm = torch.nn.utils.clip_grad_norm_(master.parameters(), 0.05)
        torch_opt.step()
        assert zoe_opt.last_grad_norm == pytest.approx(float(norm), rel=1e-5)
        for (name, reference), param in zip(master.named_parameters(), model.parameters()):
            torch.testing.assert_close(param.detach().cpu(), reference.detach(), rtol=1e-5,
                                       atol=1e-6, msg=f"step {step} {name}")
    zoe_opt.close()


def test_cuda_model_close_to_torch_adamw_on_the_gpu(engine):
    reference, model = make_model().cuda(), make_model().cuda()
    torch_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.1)
    zoe_opt = zoe.torch.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, engine=engine)
    for step in range(STEPS):
        x, y = batch(step, torch.float32, "cuda")
        for m, opt in ((reference, torch_opt), (model, zoe_opt)):
            opt.zero_grad(set_to_none=True)
            with zoe_opt.overlap():
                torch.nn.functional.mse_loss(m(x), y).backward()
            opt.step()
    for (name, a), b in zip(reference.named_parameters(), model.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=name)
    zoe_opt.close()


def test_offload_parameters_into_the_gpu(nvme_dir):
    config = gpu_config(nvme_dir, chunk_size="64K", tensor_host_budget="512K",
                        device_budget="256K")
    config["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": nvme_dir}
    with zoe.Engine(config) as engine:
        if not engine.stats()["device"]["gpu"]:
            pytest.skip("libzoe.so has no CUDA device tier")
        reference = torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(8)]).cuda()
        model = copy.deepcopy(reference)
        pager = zoe.torch.offload_parameters(model, engine)
        assert pager.tier == zoe.Tier.DEVICE
        for step in range(4):
            x, _ = batch(step, torch.float32, "cuda")
            x = x.repeat(1, 2)
            reference.zero_grad(set_to_none=True)
            model.zero_grad(set_to_none=True)
            out_ref, out = reference(x), model(x)
            assert out.is_cuda and torch.equal(out, out_ref)
            out_ref.square().sum().backward()
            out.square().sum().backward()
            for (name, p_ref), p in zip(reference.named_parameters(), model.parameters()):
                assert torch.equal(p.grad, p_ref.grad), name
        assert pager.prefetch_hit_rate() >= 0.9
        assert engine.stats()["links"]["host_to_device"]["bytes"] > 0
        pager.remove()
        assert all(p.is_cuda for p in model.parameters())


def test_a_group_of_paged_and_unpaged_cuda_parameters_trains_as_torch(nvme_dir):
    """One param group holding parameters paged into the GPU's DEVICE tier (their gradients
    streamed into host stores) and parameters left in GPU memory (their gradients in .grad, on
    the GPU): clipped by the norm of both and stepped as torch's AdamW on the GPU."""
    config = gpu_config(nvme_dir, chunk_size="64K")
    config["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": nvme_dir}
    with zoe.Engine(config) as engine:
        if not engine.stats()["device"]["gpu"]:
            pytest.skip("libzoe.so has no CUDA device tier")
        reference = make_model().cuda()
        model = copy.deepcopy(reference)
        pager = zoe.torch.offload_parameters(model[0], engine)  # the first layer only
        optimizer = zoe.torch.AdamW(model.parameters(), lr=1e-2, engine=engine, max_grad_norm=0.5)
        expected = torch.optim.AdamW(reference.parameters(), lr=1e-2)
        for step in range(6):
            x, y = batch(step, torch.float32, "cuda")
            for net, opt in ((reference, expected), (model, optimizer)):
                opt.zero_grad(set_to_none=True)
                torch.nn.functional.mse_loss(net(x), y).backward()
                if opt is expected:
                    torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)
                opt.step()
        found = {f"0.{key}": value for key, value in pager.state_dict().items()}
        found.update({key: value.detach() for key, value in model.named_parameters()
                      if not key.startswith("0.")})
        for name, value in reference.state_dict().items():
            torch.testing.assert_close(found[name].cuda(), value, rtol=1e-4, atol=1e-5, msg=name)
        optimizer.close()
        pager.remove()


def test_a_bf16_model_paged_into_the_gpu_loads_its_optimizer_state(nvme_dir):
    """The fp32 master a bf16 paged parameter's saved state holds is taken back by a fresh
    optimizer (checked against the parameter, whose memory is the GPU's)."""
    config = gpu_config(nvme_dir, chunk_size="64K")
    config["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": nvme_dir}
    with zoe.Engine(config) as engine:
        if not engine.stats()["device"]["gpu"]:
            pytest.skip("libzoe.so has no CUDA device tier")
        model = make_model(torch.bfloat16).cuda()
        pager = zoe.torch.offload_parameters(model, engine)
        optimizer = zoe.torch.AdamW(model.parameters(), lr=1e-2, engine=engine)
        for step in range(3):
            x, y = batch(step, torch.bfloat16, "cuda")
            optimizer.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(model(x).float(), y.float()).backward()
            optimizer.step()
        saved = optimizer.state_dict()
        optimizer.close()
        fresh = zoe.torch.AdamW(model.parameters(), lr=1e-2, engine=engine, name="fresh")
        fresh.load_state_dict(saved)
        fresh._zoe_group(fresh._groups[0])  # applies the loaded state (else at the first step)
        loaded = fresh.state_dict()
        for index, entry in saved["state"].items():
            assert torch.equal(loaded["state"][index]["master_param"], entry["master_param"])
        fresh.close()
        pager.remove()
