"""zoe.torch.offload_activations on a model on a GPU (run where torch sees one; skipped elsewhere,
so CI never needs one): gradients identical to keeping the activations, with device "cpu" (device
-> pinned DRAM on a side stream) and "nvme" (on to NVMe), and less device memory at the peak."""

import pytest
import torch

import zoe
import zoe.torch
from conftest import small_config
from test_activations import Model, batch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device visible to torch"
)


def cuda_gradients(model, offload=None):
    """Gradients of one forward + backward on the GPU and the peak device memory it took."""
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    x = batch(0).cuda()
    if offload is None:
        loss = model(x).square().mean()
    else:
        with offload:
            loss = model(x).square().mean()
    loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - start
    return [p.grad.clone() for p in model.parameters()], peak


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_gpu_model_is_bit_identical_and_holds_less(nvme_dir, device):
    config = small_config(nvme_dir, chunk_size="64K", tensor_host_budget="64M",
                          tensor_swap_bytes="256M")
    config["zoe"]["nvme_paths"] = [nvme_dir]
    with zoe.Engine(config) as engine:
        torch.manual_seed(0)
        model = Model(layers=4).cuda()
        expected, kept_peak = cuda_gradients(model)
        # "cpu" keeps every saved activation (1.06 MiB here) in pinned DRAM; "nvme" spills
        # what does not fit 1 MiB
        pinned = (4 << 20) if device == "cpu" else (1 << 20)
        offload = zoe.torch.offload_activations(engine, device=device, min_bytes=4096,
                                                bucket_bytes=64 << 10, pinned_bytes=pinned)
        found, peak = cuda_gradients(model, offload)
        for index, (a, b) in enumerate(zip(found, expected)):
            assert torch.equal(a, b), f"gradient {index} differs"
        stats = offload.stats()
        assert stats["per_iteration"][0]["tensors"] > 10
        assert (stats["per_iteration"][0]["bytes_to_nvme"] > 0) == (device == "nvme")
        assert peak < kept_peak, (peak, kept_peak)
        offload.wait_writes()
        assert offload.stats()["pinned_held_bytes"] == 0
