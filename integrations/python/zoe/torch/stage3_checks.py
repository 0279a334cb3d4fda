"""Misuses of ZeRO stage 3 (``offload_parameters(model, engine, process_group=pg)``, zero3.py)
refused with the fix named, rather than failing later with an unrelated error or giving wrong
values:

- a zoe optimizer sharded at ZeRO stage 1 or 2 (``zero_stage=1/2``) over the model's parameters
  or over the pager's shards: stage 3 partitions them already (check_optimizer_parameter, for
  zoe.torch's optimizers to call on each parameter they are given);
- ``model.state_dict()`` of a paged model (sharded or in one process), which would hold the
  placeholders (NaN) the parameters point at outside forward, and ``model.load_state_dict(...)``
  of its parameters, which would write into them (refuse_placeholder_state_dict and
  refuse_placeholder_load, installed on each module that owns a paged parameter). Both work
  inside ``with pager.materialized():`` (on every rank), and ``pager.state_dict()`` reads the
  values (gathers them: on every rank)."""

from .common import _invalid


def sharded_pager_of(param):
    """The ShardedParameterPager that shards ``param`` (a parameter of its model, or one of its
    shards), or None."""
    pager = getattr(param, "_zoe_sharded_pager", None)
    if pager is not None:
        return pager
    pager = getattr(param, "_zoe_pager", None)
    return pager if hasattr(pager, "shard_parameters") else None


def check_optimizer_parameter(param, where, zero_stage):
    """InvalidArgument when ``param`` is sharded by ZeRO stage 3 (a parameter of a model a
    ShardedParameterPager shards, or one of its shards) and the optimizer is sharded at ZeRO
    ``zero_stage`` 1 or 2, which would partition it again; nothing otherwise (``zero_stage``
    None or 0: an unsharded optimizer). ``where`` names the parameter ("parameter 0 of param
    group 0")."""
    if zero_stage not in (1, 2):
        return
    pager = sharded_pager_of(param)
    if pager is None:
        return
    shard = getattr(param, "_zoe_pager", None) is pager
    what = "a shard of a ShardedParameterPager" if shard else \
        "a parameter of a model sharded by a ShardedParameterPager"
    raise _invalid(
        f"{where} is {what} over {pager.world_size} ranks (ZeRO stage 3: offload_parameters(..., "
        f"process_group=pg)), and zero_stage={zero_stage} would partition it again: step the "
        "shards with zoe.torch.AdamW(pager.shard_parameters(), engine=engine) (without "
        f"zero_stage or process_group), or for ZeRO stage {zero_stage} call offload_parameters "
        "without process_group (or not at all)")


def _placeholder_error(pager, what, fix):
    """InvalidArgument for ``what`` of a paged model, outside forward, naming ``fix``."""
    world = getattr(pager, "world_size", None)
    paged = (f"a ShardedParameterPager shards over {world} ranks" if world is not None
             else "zoe pages (offload_parameters, or zoe.torch.initialize at stage 3)")
    every_rank = " on every rank (a collective)" if world is not None else ""
    return _invalid(
        f"{what} of a model whose parameters {paged} would see the placeholders (NaN) its "
        f"parameters point at outside forward: {fix}{every_rank}, or do it inside `with "
        f"pager.materialized():`{every_rank}")


def refuse_placeholder_state_dict(pager):
    """A state-dict hook (Module._register_state_dict_hook) refusing ``module.state_dict()``
    while the pager's parameters are placeholders (pager.placeholders_in_state_dict())."""
    def hook(module, state_dict, prefix, local_metadata):
        if pager.placeholders_in_state_dict():
            raise _placeholder_error(pager, "state_dict()", "call engine.module_state_dict() "
                                     "(without initialize: pager.state_dict()) for the values")
    return hook


def refuse_placeholder_load(pager, names):
    """A load_state_dict pre-hook (Module._register_load_state_dict_pre_hook) refusing to load
    the sharded parameters ``names`` (the module's own) into placeholders."""
    def hook(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
             error_msgs):
        loaded = [prefix + name for name in names if prefix + name in state_dict]
        if loaded and pager.placeholders_in_state_dict():
            raise _placeholder_error(pager, f"load_state_dict() of {loaded[0]!r}",
                                     "load a checkpoint with engine.load_checkpoint(dir, "
                                     "load_module_only=True)")
    return hook
