"""Activation checkpointing over paged parameters (offload_parameters, ZeRO stage 3's paging):
a checkpointed module's forward recomputed in backward reads its parameters, and autograd saves
them there without the pager's pack hooks. Their memory used to be released when the recomputed
forward ended, and under a budget that paged other tensors into it backward read someone else's
bytes: gradients silently wrong (both torch.utils.checkpoint forms). Now a recomputed forward's
holds pass to backward (released by each parameter's gradient hook): gradients equal the model's
without paging whenever a checkpointed segment's parameters fit the budget together (the budget
below pages the whole model in and out every iteration), and a segment that does not fit is
zoe.Busy naming the budget, never wrong values. A parameter of another module read inside the
checkpointed module (external_reads.py) is held the same way."""

import tempfile

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint

import zoe
import zoe.torch
from conftest import small_config

WIDTH = 128  # a Linear's weight is 64 KiB: one chunk, as each bias is


class Segment(torch.nn.Module):
    """Three Linears, and the embedding's weight read by name (a parameter of another module)."""

    def __init__(self, embedding):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(3))
        self.embedding = [embedding]  # a reference, not a submodule

    def forward(self, h):
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return h * torch.sigmoid(self.embedding[0].weight[:, :1].t())


class Checkpointed(torch.nn.Module):
    def __init__(self, reentrant):
        super().__init__()
        torch.manual_seed(0)
        self.embedding = torch.nn.Linear(WIDTH, WIDTH)
        self.segments = torch.nn.ModuleList(Segment(self.embedding) for _ in range(2))
        self.reentrant = reentrant

    def forward(self, x):
        h = self.embedding(x)
        for segment in self.segments:
            h = torch_checkpoint.checkpoint(segment, h, use_reentrant=self.reentrant)
        return h


def paging_config(budget):
    directory = tempfile.mkdtemp(dir="/var/tmp")
    config = small_config(directory, offload="nvme", chunk_size="64K",
                          tensor_host_budget=budget)
    config["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": directory}
    return config


def inputs():
    return torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(5)).requires_grad_()


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_gradients_equal_the_unpaged_model_under_a_budget_that_pages(reentrant):
    reference = Checkpointed(reentrant)
    reference(inputs()).square().sum().backward()
    model = Checkpointed(reentrant)
    # 10 chunks: a segment (6 tensors and the embedding's 2) fits, the model (14) does not
    with zoe.Engine(paging_config("640K")) as engine:
        pager = zoe.torch.offload_parameters(model, engine)
        for _ in range(2):  # the second iteration replays the trace
            model.zero_grad(set_to_none=True)
            model(inputs()).square().sum().backward()
        for (name, expected), found in zip(reference.named_parameters(), model.parameters()):
            assert torch.equal(found.grad, expected.grad), name
        pager.remove()


def test_a_segment_that_does_not_fit_the_budget_is_busy_not_wrong():
    model = Checkpointed(reentrant=True)
    with zoe.Engine(paging_config("256K")) as engine:  # 4 chunks: a segment needs 8
        pager = zoe.torch.offload_parameters(model, engine)
        loss = model(inputs()).square().sum()
        with pytest.raises(zoe.Busy, match="raise the host budget: zoe.tensor_host_budget "
                                           r"\(by default half of zoe.host_budget"):
            loss.backward()
        pager.remove()


class FastPath(torch.nn.Linear):
    """A Linear whose forward raises after using its weight."""

    def forward(self, h):
        super().forward(h)
        raise RuntimeError("the fast path does not take this batch")


class Fallback(torch.nn.Module):
    """A fast path that raises inside its module's forward, caught by the parent, which falls
    back: as torch >= 2.1 stops a recomputation early, the module's forward hook never runs."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embedding = torch.nn.Linear(WIDTH, WIDTH)
        self.fast = FastPath(WIDTH, WIDTH)
        self.slow = torch.nn.Linear(WIDTH, WIDTH)
        self.raise_out = False

    def forward(self, x):
        h = self.embedding(x)
        if self.raise_out:
            return self.fast(h)
        try:
            return self.fast(h)
        except RuntimeError:
            return self.slow(h)


def held(pager):
    return {record.name: (record.holds, record.backward_holds)
            for record in pager._records.values() if record.holds or record.backward_holds}


def test_a_forward_that_raises_releases_what_it_held():
    model = Fallback()
    with zoe.Engine(paging_config("640K")) as engine:
        pager = zoe.torch.offload_parameters(model, engine)
        for _ in range(3):  # caught inside the model's forward: it goes on
            model(inputs()).square().sum().backward()
            assert held(pager) == {}
            assert torch.isnan(model.embedding.weight).all()  # no forward runs: the placeholder
        model.raise_out = True
        for _ in range(2):  # out of the model's forward
            with pytest.raises(RuntimeError, match="does not take this batch"):
                model(inputs())
            assert held(pager) == {}
            assert torch.isnan(model.embedding.weight).all()
        pager.remove()
