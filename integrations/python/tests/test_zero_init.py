"""zoe.torch.zero_init: parameters paged as their modules are constructed (Linear, Embedding,
LayerNorm, custom modules, tied weights, parameters a parent rewrites) hold the values of a normal
build with the same seed, construction never holds more than about two layers' parameters,
training after offload_parameters adopts them equals a model paged after being built, the error
without offload_param, cleanup after an exception, refused mismatches and conversions, and each
rank's shard (and training) with 1 and 2 gloo ranks."""

import contextlib
import os
import weakref

import pytest
import torch
import torch.distributed as dist

import zoe
import zoe.torch
from conftest import small_config
from test_offload_parameters import TinyGPT, loss_of
from test_zero3 import Model as ShardedModel
from test_zero3 import BATCH, engine_for, init, run_ranks
from test_zero3 import loss_of as sharded_loss_of
from test_zero3 import world_of_one  # noqa: F401  (a fixture)


def paging_config(nvme_dir, device="nvme", **zoe_options):
    config = small_config(nvme_dir, offload="cpu", **zoe_options)
    config["zero_optimization"]["offload_param"] = {"device": device, "nvme_path": nvme_dir}
    return config


@pytest.fixture(params=["nvme", "cpu"])
def engine(request, nvme_dir):
    """An engine whose offload_param homes parameters on NVMe, or in DRAM."""
    with zoe.Engine(paging_config(nvme_dir, request.param)) as e:
        yield e


class Custom(torch.nn.Module):
    """Parameters of its own made before and after its submodules, and a nested module."""

    def __init__(self):
        super().__init__()
        self.first = torch.nn.Parameter(torch.randn(3, 5))
        self.inner = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.LayerNorm(4))
        self.last = torch.nn.Parameter(torch.rand(7, dtype=torch.float64))
        self.register_buffer("counts", torch.arange(4))


class TiedAfterConstruction(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(9, 6)
        self.head = torch.nn.Linear(6, 9, bias=False)


class Reinitialising(torch.nn.Module):
    """Writes its submodules' parameters in its own __init__, after they were built (and, under
    zero_init, paged): in place by nn.init and fill_, or by giving them other data."""

    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(4, 6)
        self.second = torch.nn.Linear(6, 3)
        self.norm = torch.nn.LayerNorm(3)
        torch.nn.init.zeros_(self.first.bias)
        torch.nn.init.constant_(self.second.weight, 0.5)
        self.norm.bias.data.fill_(0.25)
        self.norm.weight.data.zero_()
        self.first.weight.data = torch.randn(6, 4)
        self.second.bias = torch.nn.Parameter(torch.rand(3))


class InitialisedByApply(torch.nn.Module):
    """Ends its constructor as Hugging Face's post_init and many GPTs do: self.apply(init), with
    random in-place initialisers, over submodules already paged under zero_init."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(9, 6)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.LayerNorm(6), torch.nn.Linear(6, 6)) for _ in range(3))
        self.head = torch.nn.Linear(6, 9, bias=False)
        self.head.weight = self.embed.weight
        self.apply(self._init)

    @staticmethod
    def _init(module):
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            torch.nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, torch.nn.Linear) and module.bias is not None:
            torch.nn.init.uniform_(module.bias)


def changed_after_construction():
    model = Custom()
    torch.nn.init.ones_(model.inner[1].weight)
    model.first.data = torch.arange(15.0).view(3, 5)
    return model


def tied_after_construction():
    model = TiedAfterConstruction()
    model.head.weight = model.embed.weight  # the same Parameter in two modules
    return model


BUILDERS = {
    "linear": lambda: torch.nn.Linear(6, 5),
    "embedding": lambda: torch.nn.Embedding(10, 4),
    "layernorm": lambda: torch.nn.LayerNorm(8),
    "custom": Custom,
    "tied_in_init": TinyGPT,
    "tied_after_construction": tied_after_construction,
    "reinitialised_by_parent": Reinitialising,
    "initialised_by_apply": InitialisedByApply,
    "changed_after_construction": changed_after_construction,
}


def build(builder, seed, engine=None):
    """builder() after torch.manual_seed(seed); under zero_init when an engine is given."""
    torch.manual_seed(seed)
    if engine is None:
        return builder()
    with zoe.torch.zero_init(engine):
        return builder()


@pytest.mark.parametrize("kind", list(BUILDERS))
def test_initial_values_equal_a_normal_build(engine, kind):
    reference = build(BUILDERS[kind], 5)
    model = build(BUILDERS[kind], 5, engine)
    if kind != "changed_after_construction":  # there, one was given other data since
        assert all(p.data.stride() == (0,) * p.dim() for p in model.parameters())  # paged
    pager = zoe.torch.offload_parameters(model, engine)
    state, expected = pager.state_dict(), reference.state_dict()
    assert list(state) == list(expected)
    for key, values in expected.items():
        assert state[key].dtype == values.dtype and torch.equal(state[key], values), key
    with pager.materialized(zoe.Access.READ):
        for (name, p_ref), p in zip(reference.named_parameters(), model.parameters()):
            assert torch.equal(p, p_ref), name


def test_tied_weights_are_registered_once(engine):
    with zoe.torch.zero_init(engine) as construction:
        model = tied_after_construction()
    assert construction.parameters == 2  # embed.weight and the head's own weight (dropped)
    pager = zoe.torch.offload_parameters(model, engine)
    assert len(pager._records) == 1
    assert model.head.weight is model.embed.weight
    with zoe.torch.zero_init(engine) as again:  # the dropped head weight's tensor is reused
        torch.nn.Linear(6, 9, bias=False)
    assert again.reused == 1 and again.registered == 0


class Stack(torch.nn.Module):
    def __init__(self, layers, width):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(layers))


def storage_bytes(tensor):
    storage = tensor.untyped_storage() if hasattr(tensor, "untyped_storage") else tensor.storage()
    return storage.data_ptr(), storage.nbytes()


@contextlib.contextmanager
def live_parameter_bytes():
    """Yields a dict whose "peak" is the most bytes of storage that parameters created in the
    block held at once, measured each time a parameter is created and at the end."""
    created, result = [], {"peak": 0}
    original = torch.nn.Parameter.__dict__["__new__"]
    new = original.__func__ if isinstance(original, staticmethod) else original

    def measure():
        storages = dict(storage_bytes(p) for p in (ref() for ref in created) if p is not None)
        result["peak"] = max(result["peak"], sum(storages.values()))

    def tracking_new(cls, data=None, requires_grad=True):
        param = new(cls, data, requires_grad)
        created.append(weakref.ref(param))
        measure()
        return param

    type.__setattr__(torch.nn.Parameter, "__new__", staticmethod(tracking_new))
    try:
        yield result
        measure()
    finally:
        type.__setattr__(torch.nn.Parameter, "__new__", original)


def test_construction_holds_about_one_layer_at_a_time(nvme_dir):
    layers, width = 16, 64
    layer_bytes = (width * width + width) * 4
    with live_parameter_bytes() as normal:
        reference = build(lambda: Stack(layers, width), 2)
    assert normal["peak"] >= layers * layer_bytes  # the measure sees a whole model
    with zoe.Engine(paging_config(nvme_dir)) as engine:
        with live_parameter_bytes() as paged:
            model = build(lambda: Stack(layers, width), 2, engine)
        assert paged["peak"] <= 2 * layer_bytes, (paged["peak"], layer_bytes)
        pager = zoe.torch.offload_parameters(model, engine)
        for key, values in reference.state_dict().items():
            assert torch.equal(pager.state_dict()[key], values), key


@pytest.mark.parametrize("optimizer", ["zoe_adamw", "torch_sgd"])
def test_training_after_adoption_equals_paging_a_built_model(nvme_dir, optimizer):
    with zoe.Engine(paging_config(nvme_dir, chunk_size="4K")) as engine:
        reference = build(TinyGPT, 11)
        reference_pager = zoe.torch.offload_parameters(reference, engine)
        model = build(TinyGPT, 11, engine)
        pager = zoe.torch.offload_parameters(model, engine)
        runs = [(reference, reference_pager, "reference"), (model, pager, "adopted")]
        steppers = [stepper(m, p, optimizer, engine, name) for m, p, name in runs]
        for step in range(3):
            losses = []
            for (m, _, _), step_once in zip(runs, steppers):
                losses.append(step_once(m, step))
            assert torch.equal(losses[0], losses[1]), step
        assert reference_pager.state_dict().keys() == pager.state_dict().keys()
        for key, values in reference_pager.state_dict().items():
            assert torch.equal(pager.state_dict()[key], values), key


def stepper(model, pager, optimizer, engine, name):
    """A function (model, step) -> loss that takes one training step of ``model``."""
    if optimizer == "zoe_adamw":
        opt = zoe.torch.AdamW(model.parameters(), lr=1e-2, engine=engine, name=name)
        stepping = contextlib.nullcontext
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        stepping = pager.materialized

    def step_once(m, step):
        opt.zero_grad(set_to_none=True)
        loss = loss_of(m, step)[1]
        loss.backward()
        with stepping():
            opt.step()
        return loss.detach()
    return step_once


def test_without_offload_param_the_key_to_set_is_named(nvme_dir):
    original = torch.nn.Linear.__dict__["__init__"]
    with zoe.Engine(small_config(nvme_dir)) as engine:
        with pytest.raises(zoe.InvalidArgument, match="zero_optimization.offload_param.device"):
            with zoe.torch.zero_init(engine):
                pass
        with zoe.torch.zero_init(engine, home=zoe.Tier.HOST):  # an explicit home needs none
            layer = torch.nn.Linear(3, 3)
        zoe.torch.offload_parameters(layer, engine, home=zoe.Tier.HOST)
    assert torch.nn.Linear.__dict__["__init__"] is original


class Failing(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.built = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Embedding(5, 8))
        raise RuntimeError("construction failed")


def test_an_exception_restores_the_classes_and_abandons_what_was_paged(engine):
    originals = {cls: cls.__dict__["__init__"] for cls in (torch.nn.Module, torch.nn.Linear)}
    with pytest.raises(RuntimeError, match="construction failed"):
        with zoe.torch.zero_init(engine) as failed:
            class DefinedInside(torch.nn.Module):
                def __init__(self):
                    super().__init__()
                    self.weight = torch.nn.Parameter(torch.ones(2))

            survivor = DefinedInside()
            Failing()
    assert failed.parameters == 4 and failed.registered == 4
    for cls, init_function in originals.items():
        assert cls.__dict__["__init__"] is init_function, cls
    assert "__init_subclass__" not in torch.nn.Module.__dict__
    assert not hasattr(DefinedInside.__init__, "__wrapped__")
    assert torch.equal(DefinedInside().weight, torch.ones(2))  # no longer paged as built
    with pytest.raises(zoe.InvalidArgument, match="construction raised"):
        zoe.torch.offload_parameters(survivor, engine)
    with zoe.torch.zero_init(engine) as again:  # the tensors left behind are reused
        torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Embedding(5, 8), torch.nn.Linear(3, 3))
    assert again.reused == 3 and again.registered == 2  # the last Linear's sizes are new


class RandomlyReinitialising(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(3, 3)
        torch.nn.init.normal_(self.layer.weight)  # the weight is paged already


def test_a_random_write_into_a_paged_submodule_raises(engine):
    with pytest.raises(RuntimeError, match="more than one element"):
        with zoe.torch.zero_init(engine):
            RandomlyReinitialising()
    assert not hasattr(torch.nn.Linear.__init__, "__wrapped__")


def test_apply_outside_zero_init_is_torch_s_again(engine):
    with zoe.torch.zero_init(engine):
        pass
    assert torch.nn.Module.apply is torch.nn.Module.__dict__["apply"]
    assert not hasattr(torch.nn.Module.apply, "__wrapped__")


def test_apply_over_parameters_sharded_by_zero_init_gathers_them(engine, world_of_one):
    """Each parameter is gathered whole from the ranks' shards for the initialiser, and each
    rank keeps its slice (test_zero_init_initialize.py does it on two ranks)."""
    torch.manual_seed(3)
    expected = InitialisedByApply().state_dict()
    torch.manual_seed(3)
    with zoe.torch.zero_init(engine, process_group=world_of_one):
        model = InitialisedByApply()
    assert not hasattr(torch.nn.Module.apply, "__wrapped__")
    pager = zoe.torch.offload_parameters(model, engine, process_group=world_of_one)
    state = pager.state_dict()
    assert state.keys() == expected.keys()
    assert all(torch.equal(state[key], expected[key]) for key in expected)
    pager.remove()


def test_paged_parameters_read_nan_until_adopted_and_a_conversion_is_refused(engine):
    with zoe.torch.zero_init(engine):
        layer, converted = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    assert torch.isnan(layer.weight).all() and torch.isnan(layer.bias).all()
    pager = zoe.torch.offload_parameters(layer, engine)
    assert torch.isnan(layer.weight.data).all()  # the pager's placeholder: NaN, not zeros
    with pager.materialized():
        assert torch.isfinite(layer.weight).all()
    converted.double()
    with pytest.raises(zoe.InvalidArgument, match="converted to torch.float64"):
        zoe.torch.offload_parameters(converted, engine)


def test_contexts_do_not_nest_and_pagers_refuse_a_mismatch(engine, nvme_dir):
    with zoe.torch.zero_init(engine):
        with pytest.raises(zoe.InvalidArgument, match="do not nest"):
            with zoe.torch.zero_init(engine):
                pass
        layer = torch.nn.Linear(4, 4)
    with zoe.Engine(paging_config(nvme_dir)) as other:
        with pytest.raises(zoe.InvalidArgument, match="another engine"):
            zoe.torch.offload_parameters(layer, other)
    other_home = zoe.Tier.HOST if engine.config["zero_optimization"]["offload_param"][
        "device"] == "nvme" else zoe.Tier.NVME
    with pytest.raises(zoe.InvalidArgument, match="pass the same home"):
        zoe.torch.offload_parameters(layer, engine, home=other_home)
    zoe.torch.offload_parameters(layer, engine)
    with pytest.raises(zoe.InvalidArgument, match="already paged"):
        zoe.torch.offload_parameters(layer, engine)


# --- process groups ------------------------------------------------------------------------


def shard_of(values, rank, world_size):
    flat = values.reshape(-1)
    begin, end = zoe.shard_range(flat.numel(), rank, world_size)
    return flat[begin:end]


class ShardedBuild(torch.nn.Module):
    """test_zero3's model (uneven shards, a 1-element bias, a weight tied in __init__) beside
    one whose __init__ rewrites its submodules' parameters."""

    def __init__(self):
        super().__init__()
        self.model = ShardedModel()
        self.rewritten = Reinitialising()


def build_sharded(rank, world_size, directory):
    """One rank: ShardedBuild built under zero_init with the process group, then adopted; saves
    its shards, its full state dict and what zero_init paged."""
    init(rank, world_size, directory)
    engine, _ = engine_for(directory, rank)
    torch.manual_seed(0)
    with zoe.torch.zero_init(engine, process_group=dist.group.WORLD) as construction:
        model = ShardedBuild()
    pager = zoe.torch.offload_parameters(model, engine, process_group=dist.group.WORLD)
    shards = {}
    for name, shard in pager.named_shard_parameters():
        with pager.held(shard) as values:
            shards[name] = values.clone()
    record = {"shards": shards, "state": pager.state_dict(), "bytes": construction.bytes,
              "shard_bytes": pager.shard_bytes, "training": train_both_ways(rank, world_size,
                                                                            engine)}
    torch.save(record, os.path.join(directory, f"rank{rank}.pt"))
    dist.destroy_process_group()
    engine.close()


def train_both_ways(rank, world_size, engine, steps=3):
    """ShardedModel sharded by offload_parameters after a normal build and adopted after
    zero_init, each trained by zoe.torch.AdamW over its shards: (losses, full parameters) of
    each."""
    results = []
    for under_zero_init in (False, True):
        torch.manual_seed(0)
        with (zoe.torch.zero_init(engine, process_group=dist.group.WORLD) if under_zero_init
              else contextlib.nullcontext()):
            model = ShardedModel()
        way = "adopted" if under_zero_init else "built"
        pager = zoe.torch.offload_parameters(model, engine, process_group=dist.group.WORLD,
                                             prefix=f"{way}.", trace_name=way)
        optimizer = zoe.torch.AdamW(pager.shard_parameters(), lr=1e-2, engine=engine, name=way)
        rows = slice(BATCH * rank // world_size, BATCH * (rank + 1) // world_size)
        losses = []
        for step in range(steps):
            optimizer.zero_grad(set_to_none=True)
            loss = sharded_loss_of(model, step, rows)
            loss.backward()
            optimizer.step()
            losses.append(loss.detach())
        results.append((losses, pager.state_dict()))
    return results


@pytest.mark.parametrize("world_size", [1, 2])
def test_each_rank_keeps_only_its_shard_and_trains_as_if_built(nvme_dir, world_size):
    torch.manual_seed(0)
    reference = ShardedBuild().state_dict()
    run_ranks(build_sharded, world_size, nvme_dir)
    # zero_init also paged what construction then dropped: the head's own weight before
    # ShardedModel tied it to tokens.weight, Reinitialising's first second.bias, and its
    # first.weight twice (before and after it was given other data).
    model_bytes = sum(v.numel() * v.element_size() for k, v in reference.items()
                      if k != "model.head.weight")
    built_bytes = model_bytes + (reference["model.head.weight"].numel() + 3 + 24) * 4
    for rank in range(world_size):
        record = torch.load(os.path.join(nvme_dir, f"rank{rank}.pt"))
        assert record["shard_bytes"] <= model_bytes // world_size + 64
        assert record["shard_bytes"] < record["bytes"] <= built_bytes // world_size + 64
        for name, values in record["shards"].items():
            assert torch.equal(values, shard_of(reference[name], rank, world_size)), name
        for key, values in reference.items():
            assert torch.equal(record["state"][key], values), (rank, key)
        (built_losses, built), (adopted_losses, adopted) = record["training"]
        assert all(map(torch.equal, built_losses, adopted_losses)), rank
        assert built.keys() == adopted.keys()
        assert all(torch.equal(built[key], adopted[key]) for key in built), rank
