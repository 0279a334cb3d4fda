"""zoe.torch.offload_activations and zoe.torch.checkpoint: gradients bit-identical to keeping the
activations (CPU model to NVMe, the adversarial CPU twin to pinned DRAM and NVMe, with
torch.utils.checkpoint and zoe.torch.checkpoint, with paged parameters, with gradient
accumulation, backward twice with retain_graph); a corrupted or failed activation read is
zoe.Corruption / zoe.IoError; a forward that raised (in the model, or out of swap space) leaves no
slot, no pinned memory and no new file; 100 iterations grow nothing; the DeepSpeed
activation_checkpointing section is honoured or refused key by key."""

import contextlib
import copy
import gc
import math
import os

import pytest
import torch

import zoe
import zoe.torch
from zoe.torch import activation_checkpoint, activation_store
from conftest import small_config

WIDTH, LENGTH = 32, 64


class Block(torch.nn.Module):
    """Pre-norm attention and MLP, parameters used only by their own modules (pageable)."""

    def __init__(self):
        super().__init__()
        self.norm1 = torch.nn.LayerNorm(WIDTH)
        self.qkv = torch.nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = torch.nn.Linear(WIDTH, WIDTH)
        self.norm2 = torch.nn.LayerNorm(WIDTH)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.GELU(),
                                       torch.nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x):
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=2)
        shape = (batch, length, 4, width // 4)
        q, k, v = (t.reshape(shape).transpose(1, 2) for t in (q, k, v))
        attention = (q @ k.transpose(-2, -1) / math.sqrt(width // 4)).softmax(-1)
        x = x + self.proj((attention @ v).transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(self.norm2(x))


class Model(torch.nn.Module):
    def __init__(self, layers=2, checkpointing=None):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block() for _ in range(layers))
        self.checkpointing = checkpointing  # None, "torch" or "zoe"

    def forward(self, x):
        for block in self.blocks:
            if self.checkpointing == "torch":
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=True)
            elif self.checkpointing == "zoe":
                x = zoe.torch.checkpoint(block, x)
            else:
                x = block(x)
        return x


def batch(step):
    generator = torch.Generator().manual_seed(step)
    return torch.randn(2, LENGTH, WIDTH, generator=generator)


def gradients(model, offload=None, steps=(0,), retain=False):
    """The parameters' gradients after forward+backward of ``steps`` (accumulated), each
    forward inside ``offload`` when given."""
    model.zero_grad(set_to_none=True)
    for step in steps:
        x = batch(step).requires_grad_(model.blocks[0].qkv.weight.requires_grad)
        if offload is None:
            loss = model(x).square().mean()
        else:
            with offload:
                loss = model(x).square().mean()
        loss.backward(retain_graph=retain)
        if retain:
            loss.backward()
    return [p.grad.clone() for p in model.parameters()]


def assert_identical(found, expected):
    assert len(found) == len(expected)
    for index, (a, b) in enumerate(zip(found, expected)):
        assert torch.equal(a, b), f"gradient {index} differs"


def config(nvme_dir, **zoe_options):
    options = {"chunk_size": "64K", "tensor_host_budget": "16M", "tensor_swap_bytes": "64M"}
    options.update(zoe_options)
    document = small_config(nvme_dir, **options)
    document["zoe"]["nvme_paths"] = [nvme_dir]
    return document


@pytest.fixture
def engine(nvme_dir):
    with zoe.Engine(config(nvme_dir)) as engine:
        yield engine


@pytest.fixture(autouse=True)
def unconfigured_checkpointing():
    activation_checkpoint.reset_checkpointing()
    yield
    activation_checkpoint.reset_checkpointing()


def nvme_offload(engine, **options):
    """Buckets of one 64 KiB chunk, four of them pinned: most buckets go through NVMe."""
    options = {"device": "nvme", "min_bytes": 4096, "bucket_bytes": 64 << 10,
               "pinned_bytes": 256 << 10, **options}
    return zoe.torch.offload_activations(engine, **options)


def assert_nothing_held(offload):
    gc.collect()
    offload.wait_writes()  # slots written or evicted go back to the pool on the writer thread
    stats = offload.stats()
    assert stats["slots_in_use"] == 0 and stats["live_buckets"] == 0, stats
    assert stats["pinned_held_bytes"] == 0, stats


def swap_files(nvme_dir):
    return sorted((name, os.path.getsize(os.path.join(nvme_dir, name)))
                  for name in os.listdir(nvme_dir))


# --- gradients ---------------------------------------------------------------------------------

def test_default_budgets_make_room_for_the_largest_bucket(engine):
    """Saved tensors of 1 MiB, 16 buckets of 64 KiB: each goes alone in a bucket its size, and
    by default the pinned budget grows to it and two buckets more and backward reads it and one
    bucket ahead, so every bucket backward reads from NVMe after the first was prefetched (with
    the fixed defaults of four buckets pinned and two ahead none could be)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh())
                                  for _ in range(4)))
    x = torch.randn(1024, 256)

    def grads(offload=None):
        model.zero_grad(set_to_none=True)
        with offload if offload is not None else contextlib.nullcontext():
            loss = model(x).square().mean()
        loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    expected = grads()
    offload = zoe.torch.offload_activations(engine, device="nvme", min_bytes=4096,
                                            bucket_bytes=64 << 10)
    for _ in range(2):
        assert_identical(grads(offload), expected)
    stats = offload.stats()
    last = stats["per_iteration"][-1]
    # All five buckets (the input and four Tanh outputs) went to NVMe; the one backward needs
    # first is read on demand, every other one was read ahead.
    assert last["buckets"] == 5 and last["bytes_from_nvme"] == 5 << 20, last
    assert (last["prefetch_hits"], last["prefetch_misses"]) == (4, 1), last
    largest = 1 << 20
    assert stats["pinned_bytes"] == largest + 2 * (64 << 10)
    assert stats["prefetch_bytes"] == largest + (64 << 10)
    assert last["peak_pinned_bytes"] <= stats["pinned_bytes"]
    assert_nothing_held(offload)


def test_cpu_model_to_nvme_is_bit_identical_and_reuses_its_slots(engine):
    torch.manual_seed(0)
    model = Model()
    expected = [gradients(model, steps=(step,)) for step in range(3)]
    offload = nvme_offload(engine)
    for step in range(3):
        assert_identical(gradients(model, offload, steps=(step,)), expected[step])
    stats = offload.stats()
    first, last = stats["per_iteration"][0], stats["per_iteration"][-1]
    assert first["bytes_to_nvme"] > 0 and first["bytes_from_nvme"] > 0  # really on disk
    assert first["peak_pinned_bytes"] <= 256 << 10
    assert last["prefetch_hits"] > 0 and first["tensors"] == last["tensors"] > 10
    assert stats["slots_registered"] == first["buckets"]  # later iterations reused them
    assert_nothing_held(offload)


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_twin_model_is_bit_identical(engine, device):
    torch.manual_seed(1)
    model = Model()
    expected = gradients(model, steps=(0, 1))
    twin = zoe.torch.HostTwin()  # adversarial (conftest): copies land late, NaN until then
    pinned = {"pinned_bytes": None} if device == "cpu" else {}  # cpu: all of them pinned
    offload = nvme_offload(engine, device=device, device_backend=twin, **pinned)
    assert_identical(gradients(model, offload, steps=(0, 1)), expected)
    iteration = offload.stats()["per_iteration"][0]
    assert iteration["tensors"] > 10 and twin.copies >= 2 * iteration["tensors"]
    assert (iteration["bytes_to_nvme"] > 0) == (device == "nvme")
    assert_nothing_held(offload)


@pytest.mark.parametrize("left_out", ["end_copies", "wait_current"])
def test_twin_without_its_copy_waits_gives_wrong_gradients(engine, monkeypatch, left_out):
    # The mutations that show the waits matter: the adversarial twin's copies deliver NaN until
    # waited for. end_copies: device -> host copies read back before they ended; wait_current:
    # a restored activation used before its host -> device copy.
    torch.manual_seed(2)
    model = Model()
    expected = gradients(model)
    if left_out == "end_copies":
        monkeypatch.setattr(activation_store.Bucket, "end_copies",
                            lambda self, backend, events: None)
    else:
        monkeypatch.setattr(zoe.torch.HostTwin, "wait_current", lambda self, event: None)
    offload = nvme_offload(engine, device="cpu", device_backend=zoe.torch.HostTwin(),
                           pinned_bytes=None)
    found = gradients(model, offload)
    assert any(not torch.equal(a, b) for a, b in zip(found, expected))


def test_torch_utils_checkpoint_inside_offload(engine):
    torch.manual_seed(3)
    model = Model()
    expected = gradients(model)
    model.checkpointing = "torch"
    offload = nvme_offload(engine, min_bytes=1)
    assert_identical(gradients(model, offload), expected)
    assert offload.stats()["per_iteration"][0]["tensors"] >= 1  # the checkpoints' inputs
    assert_nothing_held(offload)


def test_zoe_checkpoint_offloads_its_inputs(engine):
    torch.manual_seed(4)
    model = Model(layers=3)
    expected = gradients(model)
    model.checkpointing = "zoe"
    # Not configured: a plain recomputation, offloading nothing (as DeepSpeed's before it is)
    assert activation_checkpoint._STATE.config is None
    assert_identical(gradients(model), expected)
    assert zoe.torch.checkpoint_profile()["calls"] == 0
    zoe.torch.configure_checkpointing(engine, {"cpu_checkpointing": True, "profile": True},
                                      bucket_bytes=64 << 10, pinned_bytes=256 << 10)
    assert_identical(gradients(model, steps=(0,)), expected)
    offload = activation_checkpoint._STATE.offload
    per_call = offload.stats()["per_iteration"]
    # One input each; the first block's is the caller's leaf tensor, which lives anyway.
    assert [s["tensors"] for s in per_call] == [0, 1, 1]
    profile = zoe.torch.checkpoint_profile()
    assert profile["calls"] == 3 and profile["recompute_seconds"] > 0
    assert_nothing_held(offload)


@pytest.mark.parametrize("synchronize", [False, True])
def test_synchronize_checkpoint_boundary_ends_the_offload_copies(engine, synchronize):
    twin = zoe.torch.HostTwin()
    section = {"cpu_checkpointing": True, "synchronize_checkpoint_boundary": synchronize}
    zoe.torch.configure_checkpointing(engine, section, device="cpu", device_backend=twin)
    torch.manual_seed(11)
    block = Block()
    x = batch(0).requires_grad_() * 1.0  # not a leaf: checkpoint's saved input is moved out
    out = zoe.torch.checkpoint(block, x)  # device -> host on the twin
    assert twin.copies == 1 and twin.in_flight() == (0 if synchronize else 1)
    out.square().mean().backward()
    assert twin.in_flight() == 0


def test_paged_parameters_compose_with_offloaded_activations(nvme_dir):
    document = config(nvme_dir)
    document["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": nvme_dir}
    with zoe.Engine(document) as engine:
        torch.manual_seed(5)
        reference = Model()
        model = copy.deepcopy(reference)
        pager = zoe.torch.offload_parameters(model, engine, home=zoe.Tier.NVME)
        offload = nvme_offload(engine)
        for step in range(2):
            assert_identical(gradients(model, offload, steps=(step,)),
                             gradients(reference, steps=(step,)))
        assert offload.stats()["per_iteration"][0]["tensors"] > 10  # inside the paged model
        assert pager.iterations == 2
        assert_nothing_held(offload)


def test_gradient_accumulation_and_backward_twice(engine):
    torch.manual_seed(6)
    model = Model()
    offload = nvme_offload(engine)
    assert_identical(gradients(model, offload, steps=(0, 1, 2)),
                     gradients(model, steps=(0, 1, 2)))
    assert_identical(gradients(model, offload, retain=True), gradients(model, retain=True))
    assert_nothing_held(offload)


# --- errors ------------------------------------------------------------------------------------

def damage_swap(nvme_dir, how):
    for name in os.listdir(nvme_dir):
        path = os.path.join(nvme_dir, name)
        if how == "overwrite":
            with open(path, "r+b") as file:
                file.write(b"\x5a" * os.path.getsize(path))
        else:
            os.truncate(path, 0)


@pytest.mark.parametrize("damage, error", [("overwrite", zoe.Corruption),
                                           ("truncate", zoe.IoError)])
def test_a_damaged_activation_read_fails_backward_and_frees_everything(engine, nvme_dir, damage,
                                                                      error):
    torch.manual_seed(7)
    model = Model()
    expected = gradients(model)
    offload = nvme_offload(engine)
    model.zero_grad(set_to_none=True)
    with offload:
        loss = model(batch(0)).square().mean()
    offload.wait_writes()
    damage_swap(nvme_dir, damage)
    # torch 1.x raises a hook's exception as a RuntimeError that starts with its class name
    with pytest.raises((error, RuntimeError), match=error.__name__) as raised:
        loss.backward()
    assert isinstance(offload.last_error, error)
    assert "zoe.activations." in str(offload.last_error)  # names the slot
    # Backward stopped at the bad read: a gradient it finished before is right, the rest absent.
    grads = [p.grad for p in model.parameters()]
    assert any(grad is None for grad in grads)
    assert all(torch.equal(grad, want) for grad, want in zip(grads, expected) if grad is not None)
    del raised, loss
    assert_nothing_held(offload)


class Failing(torch.nn.Module):
    """Raises; keeps its input, so a test can try backward through the forward that raised."""

    def forward(self, x):
        self.input = x
        raise RuntimeError("the model failed")


@pytest.mark.parametrize("cause", ["model", "swap space"])
def test_a_forward_that_raised_leaves_nothing(nvme_dir, cause):
    swap = "64M" if cause == "model" else "256K"
    with zoe.Engine(config(nvme_dir, tensor_swap_bytes=swap)) as engine:
        torch.manual_seed(8)
        model = Model(layers=3)
        if cause == "model":
            model.blocks.append(Failing())
        offload = nvme_offload(engine)
        files = swap_files(nvme_dir)
        expected = (RuntimeError, "the model failed") if cause == "model" else \
            (zoe.NoSpace, "tensor_swap_bytes")
        with pytest.raises(expected[0], match=expected[1]):
            with offload:
                model(batch(0)).sum()
        assert_nothing_held(offload)
        assert offload.stats()["per_iteration"][0]["buckets"] > 0
        assert swap_files(nvme_dir) == files
        if cause == "model":  # the graph of the forward that raised is refused, not misread
            with pytest.raises((zoe.FailedPrecondition, RuntimeError), match="forward raised"):
                model.blocks[-1].input.sum().backward()
            del model.blocks[-1].input
            assert_nothing_held(offload)


def test_a_failed_background_write_fails_the_forward(engine, monkeypatch):
    def failing_write_back(bucket):  # the engine's failed evict: released, then an error
        bucket.slot.tensor.release()
        raise zoe.IoError(zoe._capi.Status.IO, "injected write failure")

    monkeypatch.setattr(activation_store.Bucket, "write_back", failing_write_back)
    offload = nvme_offload(engine)
    with pytest.raises(zoe.IoError, match="writing saved activations .* injected write failure"):
        gradients(Model(), offload)
    assert_nothing_held(offload)


def test_a_hundred_iterations_grow_nothing(engine, nvme_dir):
    torch.manual_seed(9)
    model = Model(layers=1)
    offload = nvme_offload(engine)

    def held():
        offload.wait_writes()
        stats = offload.stats()
        host = engine.stats()["tiers"]["host"]["occupancy_bytes"]
        return stats["slots_registered"], host, swap_files(nvme_dir), _rss()

    for step in range(100):
        gradients(model, offload, steps=(step,))
        if step == 9:
            before = held()
    slots, host, files, rss = held()
    assert (slots, files) == (before[0], before[2])
    assert host <= before[1]
    assert rss - before[3] < 8 << 20, (rss, before[3])
    assert_nothing_held(offload)


def _rss():
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def test_arguments_are_checked(engine):
    with pytest.raises(zoe.InvalidArgument, match="allowed: 'auto', 'cpu', 'nvme'"):
        zoe.torch.offload_activations(engine, device="gpu")
    with pytest.raises(zoe.InvalidArgument, match="min_bytes = 0"):
        zoe.torch.offload_activations(engine, min_bytes=0)
    offload = nvme_offload(engine)
    with offload:
        with pytest.raises(zoe.FailedPrecondition, match="do not nest"):
            with offload:
                pass
    with pytest.raises(zoe.InvalidArgument, match="two buckets"):
        zoe.torch.offload_activations(engine, device="nvme", bucket_bytes=64 << 10,
                                      pinned_bytes=64 << 10)
    if not torch.cuda.is_available():
        with pytest.raises(zoe.InvalidArgument, match="use device='nvme'"):
            with zoe.torch.offload_activations(engine, device="cpu"):
                pass
    offload = nvme_offload(engine, device="cpu", device_backend=zoe.torch.HostTwin(),
                           pinned_bytes=128 << 10)
    with pytest.raises(zoe.OutOfMemory, match="pinned_bytes is 131072"):
        gradients(Model(), offload)
    assert_nothing_held(offload)


# --- the DeepSpeed section ---------------------------------------------------------------------

def test_the_deepspeed_section_is_checked_key_by_key():
    parse = activation_checkpoint.checkpointing_config
    every = {"cpu_checkpointing": True, "partition_activations": False,
             "contiguous_memory_optimization": True, "number_checkpoints": 4,
             "synchronize_checkpoint_boundary": True, "profile": False}
    assert parse(every) == activation_checkpoint.CheckpointingConfig(**every)
    with pytest.raises(zoe.InvalidArgument, match="partition_activations.*model parallel"):
        parse({"partition_activations": True})
    with pytest.raises(zoe.InvalidArgument, match="unknown key.*cpu_checkpoint'"):
        parse({"cpu_checkpoint": True})
    with pytest.raises(zoe.InvalidArgument, match="profile: expected true or false"):
        parse({"profile": "yes"})
    with pytest.raises(zoe.InvalidArgument, match="number_checkpoints = 0"):
        parse({"number_checkpoints": 0})


def checkpointed_through_initialize(document):
    """(the model, its gradients without checkpointing, the engine and optimizer initialize
    built for ``document``); the model then checkpoints with zoe.torch.checkpoint."""
    torch.manual_seed(10)
    model = Model()
    expected = gradients(model)
    model.checkpointing = "zoe"
    engine, optimizer, _, _ = zoe.torch.initialize(model=model, config=document)
    return model, expected, engine, optimizer


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_initialize_offloads_checkpoints_with_the_optimizers_engine_as_configured(stage):
    """Below stage 3 the checkpoints go to the engine of the optimizer, which reserves tensor
    swap for its device staging only: a config that does not size it gets automatic swap, where
    the first offloaded bucket failed with NoSpace naming a key the user never set."""
    document = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage},
        "activation_checkpointing": {"cpu_checkpointing": True},
    }
    model, expected, engine, optimizer = checkpointed_through_initialize(document)
    try:
        assert optimizer.engine.config["zoe"]["tensor_swap_bytes"] == 0
        assert_identical(gradients(model), expected)
        offload = activation_checkpoint._STATE.offload
        assert offload.engine is optimizer.engine
        assert offload.stats()["per_iteration"][-1]["tensors"] > 0  # the checkpoints went out
    finally:
        engine.close()


def test_initialize_honours_activation_checkpointing(nvme_dir):
    document = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
        "activation_checkpointing": {"cpu_checkpointing": True,
                                     "synchronize_checkpoint_boundary": True,
                                     "contiguous_memory_optimization": True,
                                     "number_checkpoints": 2, "profile": True},
        "zoe": config(nvme_dir)["zoe"],
    }
    model, expected, engine, optimizer = checkpointed_through_initialize(document)
    try:
        assert_identical(gradients(model), expected)
        offload = activation_checkpoint._STATE.offload
        assert offload.engine is optimizer.engine and offload.device == "nvme"
        assert zoe.torch.checkpoint_profile()["calls"] == 2
    finally:
        engine.close()
    # Closing the engine forgets the configuration that offloads into it: the next engine's
    # checkpoint() recomputes without offloading, not into an engine it never had, closed.
    assert activation_checkpoint._STATE.offload is None
    without = {key: value for key, value in document.items() if key != "activation_checkpointing"}
    engine, _, _, _ = zoe.torch.initialize(model=model, config=without)
    assert_identical(gradients(model), expected)
    engine.close()
    document["activation_checkpointing"] = {"partition_activations": True}
    with pytest.raises(zoe.InvalidArgument, match="partition_activations"):
        zoe.torch.initialize(model=Model(), config=document)
    # A torch optimizer at stage 0 has no zoe engine to offload to.
    document["activation_checkpointing"] = {"cpu_checkpointing": True}
    document["zero_optimization"] = {"stage": 0}
    del document["optimizer"]
    model = Model()
    with pytest.raises(zoe.InvalidArgument, match="cpu_checkpointing false"):
        zoe.torch.initialize(model=model, config=document,
                             optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
