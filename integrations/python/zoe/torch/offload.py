"""zoe.torch.offload_parameters: a module's parameters paged through a zoe engine, by one rank
(ParameterPager, paging.py) or sharded across a process group's ranks (ShardedParameterPager,
zero3.py)."""

import torch

from .. import _capi
from .common import _invalid
from .paging import ParameterPager
from .stage3_keep import (DEEPSPEED_MAX_LIVE_PARAMETERS, DEEPSPEED_MAX_REUSE_DISTANCE,
                          KeptForBackward)
from .zero3 import DEFAULT_PREFETCH_DEPTH, offload_sharded


def _home_from_config(engine):
    """HOST for ``zero_optimization.offload_param.device = "cpu"``, else NVME."""
    device = engine.config.get("zero_optimization", {}).get("offload_param", {}).get("device")
    return _capi.Tier.HOST if device == "cpu" else _capi.Tier.NVME


def _kept_for_backward(max_live_parameters, max_reuse_distance):
    """The stage 3 keep policy of offload_parameters' arguments (see its docstring)."""
    if max_live_parameters is None and max_reuse_distance is None:
        return KeptForBackward()
    return KeptForBackward(
        DEEPSPEED_MAX_LIVE_PARAMETERS if max_live_parameters is None else max_live_parameters,
        DEEPSPEED_MAX_REUSE_DISTANCE if max_reuse_distance is None else max_reuse_distance)


def _refuse_stage3_options(**options):
    """InvalidArgument naming the first of ``options`` given (not None) without a
    process_group: they apply to ZeRO stage 3 only."""
    for name, value in options.items():
        if value is not None:
            raise _invalid(f"{name} = {value!r} applies to ZeRO stage 3 (with a process_group); "
                           "a pager without one gathers nothing and reduces nothing")


def offload_parameters(model, engine, home=None, trace_name="iteration", prefix="param.",
                       tier=None, process_group=None, prefetch_depth=None,
                       bucket_elements=None, max_live_parameters=None, max_reuse_distance=None):
    """Pages the parameters of ``model`` through ``engine``, ZeRO-3 style.

    Every parameter becomes a zoe tensor homed in ``home`` (NVME or HOST) holding its values;
    ``param.data`` is replaced by a one-element placeholder expanded to the parameter's shape.
    ``home=None`` follows the engine's ``zero_optimization.offload_param.device`` as DeepSpeed
    does: ``"cpu"`` homes parameters in pinned DRAM, ``"nvme"`` (and ``"none"``, since calling
    this function asks for offloading) on NVMe.

    * Forward: a module's pre-hook acquires its own parameters (HOST tier) and points
      ``param.data`` at the acquired memory; its post-hook releases them.
    * Backward: tensors autograd saves that live in parameter memory are packed as references to
      the parameter (``torch.autograd.graph.saved_tensors_hooks``) and re-acquired when backward
      unpacks them, so nothing stays acquired between a module's forward and its backward. What
      backward acquired is released by the parameter's gradient hook, or at the end of backward.
    * Gradients land in ordinary ``param.grad`` tensors. zoe.torch's optimizers step
      paged parameters directly (each is acquired for writing while its new values are copied
      from the master weights); a torch optimizer steps them inside ``with pager.materialized():``
      (which needs every parameter in DRAM at once).
    * Each forward + backward is one trace iteration: the first is recorded, later ones prefetch
      by it. An iteration without backward (no grad) ends with its forward.

    * ``tier``: where a parameter is acquired while in use. ``zoe.Tier.HOST`` (pinned DRAM, for a
      model on the CPU) or ``zoe.Tier.DEVICE`` (the engine's device tier, HOST as staging, with
      prefetch and eviction by the trace on both links): GPU memory wrapped as a CUDA tensor for
      a model on a GPU, the host stand-in's memory as CPU tensors for a model on the CPU (the CPU
      twin). ``None``: DEVICE for a model on a GPU, else HOST.

    * ``process_group``: ZeRO stage 3 across its ranks: each rank pages only its shard of every
      parameter, a module's parameters are all-gathered around its forward and backward (the
      next ``prefetch_depth`` gathers issued ahead by the trace; None: 2) and gradients reduced
      to the owning shard in buckets of ``bucket_elements`` elements or more (None: 4 Mi, as
      the stage 1 and 2 optimizer's; 0 or 1: one parameter per bucket); returns a
      ShardedParameterPager (zoe/torch/zero3.py, docs/zero3.md). ``max_live_parameters`` and
      ``max_reuse_distance`` (DeepSpeed's stage3_ keys, elements) keep full parameters from
      forward to backward (stage3_keep.py): None for both keeps none, one given leaves the
      other at 1e9. Without a process_group these four are refused.

    Returns a :class:`ParameterPager` (statistics, ``materialized()``, ``remove()``).
    """
    if home is None:
        home = _home_from_config(engine)
    if tier is None:
        on_gpu = any(param.device.type == "cuda" for param in model.parameters())
        tier = _capi.Tier.DEVICE if on_gpu else _capi.Tier.HOST
    if process_group is not None:
        depth = DEFAULT_PREFETCH_DEPTH if prefetch_depth is None else prefetch_depth
        keep = _kept_for_backward(max_live_parameters, max_reuse_distance)
        return offload_sharded(model, engine, home, trace_name, prefix, tier, process_group,
                               depth, bucket_elements, keep)
    _refuse_stage3_options(prefetch_depth=prefetch_depth, bucket_elements=bucket_elements,
                           max_live_parameters=max_live_parameters,
                           max_reuse_distance=max_reuse_distance)
    pager = ParameterPager(model, engine, trace_name, home, tier)
    with torch.no_grad():
        pager._register(prefix)
    pager._install_hooks()
    return pager
