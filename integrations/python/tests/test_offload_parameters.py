"""zoe.torch.offload_parameters on a small transformer: outputs and gradients identical to the
same model without paging, trace-driven prefetch hits after the first iteration, optimizer steps
on paged parameters, and removing the hooks."""

import copy
import math

import pytest
import torch

import zoe
import zoe.torch
from conftest import small_config


class Block(torch.nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.norm1 = torch.nn.LayerNorm(width)
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.proj = torch.nn.Linear(width, width)
        self.norm2 = torch.nn.LayerNorm(width)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width)
        )

    def forward(self, x):
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=2)
        shape = (batch, length, self.heads, width // self.heads)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-2, -1) / math.sqrt(width // self.heads)
        mask = torch.ones(length, length, dtype=torch.bool).tril()
        attention = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        y = (attention @ v).transpose(1, 2).reshape(batch, length, width)
        x = x + self.proj(y)
        return x + self.mlp(self.norm2(x))


class TinyGPT(torch.nn.Module):
    """Token and position embeddings (a root-level parameter), two blocks, a tied output head."""

    def __init__(self, vocab=40, width=32, heads=4, layers=2, length=16):
        super().__init__()
        self.tokens = torch.nn.Embedding(vocab, width)
        self.positions = torch.nn.Parameter(torch.randn(length, width) * 0.02)
        self.blocks = torch.nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tokens.weight

    def forward(self, idx):
        x = self.tokens(idx) + self.positions[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def tokens(step):
    generator = torch.Generator().manual_seed(step)
    return torch.randint(0, 40, (4, 17), generator=generator)


def loss_of(model, step):
    idx = tokens(step)
    logits = model(idx[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 40), idx[:, 1:].reshape(-1))
    return logits, loss


@pytest.fixture
def paging_engine(nvme_dir):
    # 4 KiB chunks and a 64 KiB HOST tier for tensors: about half of TinyGPT's parameters fit,
    # so every iteration reads parameters back from NVMe and prefetching matters.
    config = small_config(nvme_dir, offload="cpu", chunk_size="4K", tensor_host_budget="64K")
    config["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": nvme_dir}
    with zoe.Engine(config) as engine:
        yield engine


def test_outputs_and_gradients_identical_and_prefetch_hits(paging_engine):
    torch.manual_seed(0)
    reference = TinyGPT()
    model = copy.deepcopy(reference)
    pager = zoe.torch.offload_parameters(model, paging_engine, home=zoe.Tier.NVME)
    assert all(p.data.stride() == (0,) * p.dim() for p in model.parameters())
    for step in range(4):
        reference.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        logits_ref, loss_ref = loss_of(reference, step)
        logits, loss = loss_of(model, step)
        assert torch.equal(logits, logits_ref)
        loss_ref.backward()
        loss.backward()
        for (name, p_ref), p in zip(reference.named_parameters(), model.parameters()):
            assert p.grad is not None and torch.equal(p.grad, p_ref.grad), name
    assert pager.iterations == 4
    assert pager.prefetch_hit_rate() >= 0.9
    stats = pager.stats()
    assert stats["per_iteration"][0]["misses"] > 0  # the first, recorded iteration faulted in
    assert all(s["nvme_to_host_bytes"] > 0 for s in stats["per_iteration"])  # real paging
    assert stats["engine"]["trace"]["matched"] > 0
    assert stats["engine"]["tiers"]["host"]["peak_occupancy_bytes"] <= 64 * 1024


def test_optimizer_steps_paged_parameters(paging_engine):
    # The same zoe optimizer on the same model with and without paging: paging must change
    # nothing, so the parameters agree bit for bit.
    torch.manual_seed(1)
    reference = TinyGPT()
    model = copy.deepcopy(reference)
    pager = zoe.torch.offload_parameters(model, paging_engine)
    reference_opt = zoe.torch.AdamW(reference.parameters(), lr=1e-2, engine=paging_engine,
                                    name="reference")
    zoe_opt = zoe.torch.AdamW(model.parameters(), lr=1e-2, engine=paging_engine, name="paged")
    for step in range(3):
        for m, opt in ((reference, reference_opt), (model, zoe_opt)):
            opt.zero_grad(set_to_none=True)
            loss_of(m, step)[1].backward()
        reference_opt.step()
        zoe_opt.step()  # acquires one parameter at a time: the model does not fit the budget
    for (name, p_ref), p in zip(reference.named_parameters(), model.parameters()):
        with pager.held(p) as values:
            assert torch.equal(values, p_ref), name
    state, reference_state = zoe_opt.state_dict(), reference_opt.state_dict()
    for index, entry in state["state"].items():
        assert torch.equal(entry["exp_avg_sq"], reference_state["state"][index]["exp_avg_sq"])
    pager.remove()
    assert all(p.is_contiguous() for p in model.parameters())
    assert torch.equal(loss_of(model, 9)[0], loss_of(reference, 9)[0])


def test_torch_optimizer_inside_materialized(nvme_dir):
    with zoe.Engine(small_config(nvme_dir)) as engine:  # room for every parameter at once
        torch.manual_seed(3)
        reference = TinyGPT()
        model = copy.deepcopy(reference)
        pager = zoe.torch.offload_parameters(model, engine, home=zoe.Tier.HOST)
        optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (reference, model)]
        for step in range(2):
            for m, opt in zip((reference, model), optimizers):
                opt.zero_grad()
                loss_of(m, step)[1].backward()
            optimizers[0].step()
            with pager.materialized():
                optimizers[1].step()
        with pager.materialized():
            for p_ref, p in zip(reference.parameters(), model.parameters()):
                assert torch.equal(p, p_ref)
        pager.remove()


def test_no_grad_forward_is_an_iteration(paging_engine):
    torch.manual_seed(2)
    reference = TinyGPT()
    model = copy.deepcopy(reference)
    pager = zoe.torch.offload_parameters(model, paging_engine, home=zoe.Tier.HOST)
    with torch.no_grad():
        for step in range(3):
            assert torch.equal(loss_of(model, step)[0], loss_of(reference, step)[0])
    assert pager.iterations == 3
    saved, expected = pager.state_dict(), reference.state_dict()
    assert saved.keys() == expected.keys()
    assert all(torch.equal(saved[key], expected[key]) for key in expected)
    pager.remove()
    for p_ref, p in zip(reference.parameters(), model.parameters()):
        assert torch.equal(p, p_ref)


@pytest.mark.parametrize("device,home", [("cpu", zoe.Tier.HOST), ("nvme", zoe.Tier.NVME)])
def test_home_follows_offload_param_device(nvme_dir, device, home):
    config = small_config(nvme_dir)
    config["zero_optimization"]["offload_param"] = {"device": device, "nvme_path": nvme_dir}
    with zoe.Engine(config) as engine:
        torch.manual_seed(4)
        reference = TinyGPT()
        model = copy.deepcopy(reference)
        pager = zoe.torch.offload_parameters(model, engine)
        assert pager.home == home
        with torch.no_grad():
            assert torch.equal(loss_of(model, 0)[0], loss_of(reference, 0)[0])
        pager.remove()
