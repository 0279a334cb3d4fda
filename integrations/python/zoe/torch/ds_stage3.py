"""ZeRO stage 3 under zoe.torch.initialize: the module's parameters paged through a zoe engine
(offload_parameters; homed in DRAM for offload_param "none"/"cpu", on NVMe for "nvme") and, over a
process group, partitioned across its ranks (a ShardedParameterPager, docs/zero3.md); the optimizer
(the config's zoe.torch optimizer on the same engine) steps this rank's shards of the trainable
parameters, or the paged trainable parameters in one process (the frozen ones stay paged, and the
checkpoints keep their values). The gradients stream out of backward into the optimizer
(grad_stream.py), which clips them to gradient_clipping by the global norm over every rank's shards
and skips a non-finite step on every rank; under fp16 the engine takes that skip as the overflow
(every rank alike) and lowers the loss scale.

Stage3 holds the pager and the zoe engine, and does for the DeepSpeedEngine what paging changes:
the module's state dict (gathered), checkpoints (the pager's sharded ones over ranks), loading a
checkpoint's module values into the paged parameters, and closing."""

import dataclasses
from typing import Any

import torch.distributed as dist

from .. import _capi
from ..engine import Engine
from .._capi import Access, Tier
from ..errors import FailedPrecondition
from .checkpoint import OneProcess, load_shard
from .common import _invalid
from .distributed import shard_bounds, shard_counts
from .ds_config import AUTO
from .ds_zero_init import adopted_engine
from .frozen_values import has_frozen, load_with_frozen, save_with_frozen
from .offload import offload_parameters
from .optimizer import OPTIMIZERS
from .paging import _distinct_named_parameters
from .stage3_keep import (DEEPSPEED_MAX_LIVE_PARAMETERS, DEEPSPEED_MAX_REUSE_DISTANCE,
                          elements_setting)


@dataclasses.dataclass
class Stage3:
    """The paging side of a stage 3 engine (see the module docstring)."""
    pager: Any
    engine: Engine
    sharded: bool
    # (param group dict, its parameter list as given): the optimizer's param groups hold what
    # zoe steps in the meantime, and close() puts the lists back
    given_lists: list = dataclasses.field(default_factory=list)

    def module_state(self, destination=None, prefix=""):
        """The module's state dict with its parameters' values (a collective when sharded),
        its keys led by ``prefix``, put into ``destination`` when given (and returned)."""
        state = self.pager.state_dict()
        if destination is None and not prefix:
            return state
        destination = type(state)() if destination is None else destination
        destination.update((prefix + key, value) for key, value in state.items())
        return destination

    def load_module(self, state, optimizer, strict=True, custom_load_fn=None,
                    with_optimizer=False):
        """Loads a checkpoint's module ``state`` (module_state()'s full values): its buffers
        into the module and, unless ``with_optimizer``, each parameter's values into its paged
        memory (over ranks this rank's slice into its shard), one parameter at a time, the
        optimizer's master weights following them while its moments and step counts stay
        (DeepSpeed's refresh of its fp32 weights after a module-only load).
        ``with_optimizer``: the optimizer's checkpoint was loaded before: it set every
        parameter it steps to its master weights and the frozen ones to their saved values,
        which the parameters keep (after a ``custom_load_fn`` the stepped ones are written
        again).
        ``strict``: keys missing from ``state`` or unknown to the module are refused before
        anything changes (RuntimeError, as torch's load_state_dict); otherwise a parameter
        missing keeps its values. ``custom_load_fn(src=state, dst=model)``, when given, loads
        instead, inside pager.materialized() (every parameter gathered at once; a collective
        over ranks)."""
        model = self.pager.model
        if custom_load_fn is not None:
            with self.pager.materialized():
                custom_load_fn(src=state, dst=model)
            if with_optimizer:
                optimizer.write_back_masters()
        else:
            check_module_state(model, state, strict)
            names = {key for key, _ in every_named_parameter(model)}
            model.load_state_dict({key: value for key, value in state.items()
                                   if key not in names}, strict=False)
            if not with_optimizer:
                for name, param in model.named_parameters():
                    if name in state:
                        self._write_parameter(param, state[name])
        if not with_optimizer:
            refresh_masters(optimizer)

    def _write_parameter(self, param, values):
        """Writes ``values`` (a full parameter's) into ``param``'s paged memory, or over ranks
        this rank's slice of them into its shard."""
        if param.numel() == 0:
            return  # never paged
        target, flat = param, values.detach().reshape(-1)
        if self.sharded:
            target = self.pager.shard_of(param)
            if target is None:
                return  # this rank's shard is empty
            begin, end = shard_bounds(param.numel(), self.pager.rank, self.pager.world_size)
            flat = flat[begin:end]
        with self.pager.held(target, Access.WRITE) as memory:
            memory.copy_(flat.view(memory.shape))

    def save(self, directory, optimizer, rank):
        """The optimizer, the parameters it steps and the values of the others (frozen
        parameters: frozen_values.py): every rank its shards, or rank 0."""
        if self.sharded:
            self.pager.save_checkpoint(directory, optimizer)
        elif rank == 0:
            save_with_frozen(directory, optimizer, self.pager, self._frozen(optimizer))

    def load(self, directory, optimizer):
        """Loads what save wrote; the parameters take the saved master weights, the frozen
        ones their saved values. In one process with frozen parameters the load runs as
        checkpoint.load_shard runs a rank's (frozen_values.load_with_frozen: the values checked
        before the optimizer loads, and a failure after it puts both back); a save written
        before they were kept (its optimizer held the frozen parameters) is refused naming what
        loads it."""
        if self.sharded:
            self.pager.load_checkpoint(directory, optimizer)
            return
        frozen = self._frozen(optimizer)
        if not frozen and not has_frozen(directory):
            optimizer.load_checkpoint(directory)
            return
        if not has_frozen(directory):
            raise FailedPrecondition(
                _capi.Status.FAILED_PRECONDITION,
                f"the checkpoint in {directory!r} was saved by a zoe whose stage 3 "
                "optimizer held the frozen parameters (those no param group holds) with the "
                "trainable ones, and this optimizer holds only the trainable ones: load it "
                "with load_optimizer_states=False (the module's saved values, frozen ones "
                "too, and a fresh optimizer state)")
        load_shard(OneProcess(), f"loading {directory!r}", directory,
                   lambda path: save_with_frozen(path, optimizer, self.pager, frozen),
                   lambda path: load_with_frozen(path, optimizer, self.pager, frozen,
                                                 f"the checkpoint in {path!r}"))

    def _frozen(self, optimizer):
        """(layout index, name, parameter) of the paged parameters (one process) that no param
        group of ``optimizer`` holds, in the module's order (each parameter once, by its first
        name)."""
        stepped = {id(param) for group in optimizer.param_groups for param in group["params"]}
        return [(index, name, param) for index, (name, param)
                in enumerate(_distinct_named_parameters(self.pager.model))
                if param.numel() > 0 and id(param) not in stepped]

    def close(self, optimizer):
        """Gives the module ordinary parameters again (a collective when sharded), closes the
        optimizer and the engine, and puts the param groups' parameter lists back as given (a
        torch optimizer given holds the module's parameters again)."""
        try:
            self.pager.remove()
        finally:
            optimizer.close()
            self.engine.close()
            _put_back(self.given_lists)


def every_named_parameter(module):
    """(state dict key, parameter) for each of ``module``'s parameters, a tied one under each
    of its names (as module.state_dict() lists them)."""
    return [(f"{prefix}.{name}" if prefix else name, param)
            for prefix, owner in module.named_modules(remove_duplicate=False)
            for name, param in owner._parameters.items() if param is not None]


def _buffer_keys(module):
    """The keys of ``module``'s persistent buffers in its state dict."""
    return [f"{prefix}.{name}" if prefix else name
            for prefix, owner in module.named_modules(remove_duplicate=False)
            for name, buffer in owner._buffers.items()
            if buffer is not None and name not in owner._non_persistent_buffers_set]


def check_module_state(module, state, strict, expected=None):
    """RuntimeError, worded as torch's load_state_dict words it, for a saved tensor whose
    shape is not the module's and, when ``strict``, for keys of the module missing from
    ``state`` or keys of ``state`` the module does not have. ``expected``: {key: shape, or None
    where no shape is checked} of the module's state dict; by default its parameters (as
    every_named_parameter lists them: at stage 3 module.state_dict() would gather) and
    persistent buffers. Changes nothing."""
    if expected is None:
        expected = {key: tuple(param.shape) for key, param in every_named_parameter(module)}
        expected.update((key, None) for key in _buffer_keys(module) if key not in expected)
    sizes = _size_mismatches(expected, state)
    keys = _key_mismatches(expected, state) if strict else []
    if not (keys or sizes):
        return
    if sizes:  # no switch loads another shape
        way_out = "the checkpoint holds a model of other shapes: load it into the model it was "\
            "saved from"
    else:
        way_out = "load_checkpoint(..., load_module_strict=False) keeps the module's own values "\
            "for the missing keys and ignores the unexpected ones"
    raise RuntimeError(f"Error(s) in loading state_dict for {type(module).__name__}:\n\t"
                       + "\n\t".join(keys + sizes) + f"\n({way_out})")


def _size_mismatches(expected, state):
    return [f"size mismatch for {key}: copying a param with shape {tuple(state[key].shape)} "
            f"from checkpoint, the shape in current model is {shape}."
            for key, shape in expected.items()
            if shape is not None and key in state and hasattr(state[key], "shape")
            and tuple(state[key].shape) != shape]


def _key_mismatches(expected, state):
    missing = [key for key in expected if key not in state]
    unexpected = [key for key in state if key not in expected]
    errors = []
    for what, keys in (("Missing", missing), ("Unexpected", unexpected)):
        if keys:
            errors.append(f"{what} key(s) in state_dict: "
                          + ", ".join(f'"{key}"' for key in keys) + ".")
    return errors


def refresh_masters(optimizer):
    """Sets each param group's master weights to its paged parameters' current values, one
    parameter at a time (DeepSpeed's refresh_fp32_params); a group whose zoe state is not
    created yet takes them when it is."""
    for state in optimizer._groups:
        if state.zoe_group is not None:
            optimizer._write_paged_masters(state)


def _home(training):
    return Tier.NVME if training.offload_param == "nvme" else Tier.HOST


# By default, full parameters kept for backward take at most this share of the budget of the
# memory they are gathered in (_gathered_in_bytes).
KEEP_SHARE = 4


def keep_settings(document, gathered_in_bytes, element_size):
    """offload_parameters' max_live_parameters and max_reuse_distance from
    zero_optimization.stage3_max_live_parameters / stage3_max_reuse_distance (stage3_keep.py).
    Absent or "auto": DeepSpeed's defaults (1e9 each), the live parameters at most the
    ``element_size``-byte elements that fill 1/KEEP_SHARE of ``gathered_in_bytes``, so that
    keeping never takes much more memory than zoe is given there. A value given is kept."""
    zero = document.get("zero_optimization", {})
    within_budget = gathered_in_bytes // KEEP_SHARE // max(1, element_size)
    settings = {}
    for name, default in (
            ("max_live_parameters", min(DEEPSPEED_MAX_LIVE_PARAMETERS, within_budget)),
            ("max_reuse_distance", DEEPSPEED_MAX_REUSE_DISTANCE)):
        key = "stage3_" + name
        value = zero.get(key)
        settings[name] = elements_setting(f"zero_optimization.{key}",
                                          default if value in (None, AUTO) else value)
    return settings


def _gathered_in_bytes(module, engine):
    """The budget of the memory a module's full parameters are gathered in: the engine's
    device budget for a model on a GPU, else its tensors' HOST budget."""
    on_gpu = any(param.device.type == "cuda" for param in module.parameters())
    return int(engine.config["zoe"]["device_budget" if on_gpu else "tensor_host_budget"])


def _optimized(module, pager, sharded, param_groups):
    """What the stage 3 optimizer is built over: the trainable parameters (requires_grad; this
    rank's non-empty shards of them when ``sharded``) in one group, or ``param_groups``
    themselves (their settings over the config's; the very dicts, so that a schedule over
    their first owner sets the optimizer's rates) without their frozen parameters, whose
    parameters the optimizer takes as this rank's shards of them (the zoe.torch optimizers put
    a sharded model's parameters' shards in their place); the parameters never paged (no
    elements) are left out when sharded, as from shard_parameters(). The frozen parameters
    stay paged, outside the optimizer (the checkpoints keep their values: frozen_values.py);
    a group of frozen parameters only is kept, empty on every rank."""
    if param_groups is None:
        params = pager.shard_parameters() if sharded else list(module.parameters())
        return [param for param in params if param.requires_grad]
    for group in param_groups:
        group["params"] = [param for param in group["params"]
                           if param.requires_grad and (not sharded or param.numel() > 0)]
    return param_groups


def check_groups_on_every_rank(param_groups, world_size):
    """InvalidArgument, the same on every rank, for a param group of which some rank would hold
    no shard (all its trainable parameters smaller than the world size): every rank's optimizer
    must have the same groups, each taking part in the step's collectives."""
    for number, param_group in enumerate(param_groups or []):
        counts = [shard_counts(param.numel(), world_size) for param in param_group["params"]
                  if param.requires_grad]
        if not any(any(c) for c in counts):
            continue  # empty on every rank alike (a group of no parameter): no rank differs
        empty = [rank for rank in range(world_size) if not any(c[rank] for c in counts)]
        if empty:
            raise _invalid(f"param group {number} would hold no parameter shard on rank "
                           f"{empty[0]} of {world_size}: its parameters are smaller than the "
                           "world size; move them into a group with a larger parameter")


def stage3_setup(module, spec, document, training, group, param_groups=None):
    """(Stage3, the optimizer) for ``module`` under the config's optimizer ``spec``, over
    ``param_groups`` (dicts of the module's parameters and settings of their own, which the
    optimizer takes as its own; None: one group of every parameter). The engine is the one
    zero_init(config=...) built the module paged into (ds_zero_init.adopted_engine), else one
    made from ``document``."""
    optimizer_class = OPTIMIZERS[spec["type"]]
    optimizer_class.check_param_groups(param_groups)  # refused before the module is paged
    if group is not None:
        check_groups_on_every_rank(param_groups, dist.get_world_size(group))
    given_lists = [(param_group, param_group["params"]) for param_group in param_groups or []]
    engine, pager = adopted_engine(module, document) or Engine(document), None
    try:
        keep = keep_settings(  # checked in one process too, where nothing is kept
            document, _gathered_in_bytes(module, engine),
            max((param.element_size() for param in module.parameters()), default=4))
        sharding = {} if group is None else keep
        if group is not None and training.reduce_bucket_size is not None:
            sharding["bucket_elements"] = training.reduce_bucket_size
        pager = offload_parameters(module, engine, home=_home(training), process_group=group,
                                   **sharding)
        params = _optimized(module, pager, group is not None, param_groups)
        optimizer = optimizer_class(params, **spec["params"], engine=engine,
                                    max_grad_norm=training.gradient_clipping)
    except BaseException:
        if pager is not None:  # the module's own parameters back, with their values
            pager.remove()
        engine.close()
        _put_back(given_lists)
        raise
    return Stage3(pager, engine, group is not None, given_lists), optimizer


def _put_back(given_lists):
    """Stage3.given_lists' parameter lists back in their param group dicts."""
    for param_group, params in given_lists:
        param_group["params"] = params
