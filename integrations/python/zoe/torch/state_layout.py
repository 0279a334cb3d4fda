"""zoe optimizer state in torch's layout (what state_dict() returns and load_state_dict()
takes): per parameter 'step' (a float32 scalar tensor) and the optimizer kind's moments under
torch's names (optim_kinds.py: 'exp_avg' and 'exp_avg_sq' for Adam/AdamW, 'sum' for Adagrad,
'exp_avg' for Lion; float32, the parameter's shape), plus 'master_param' for bfloat16 and float16
parameters (the fp32 master weights). The unsharded optimizer and the ZeRO one (zero.py) both
build and read it here; a zoe group holds a param group's parameters concatenated, so a slot of
the group is one flat fp32 tensor that these functions cut per parameter."""

import torch

from .. import _capi
from .common import _current_values, _invalid
from .optim_kinds import KINDS
from .stage3_checks import sharded_pager_of

# Every moment name of every kind: a state holding one its optimizer does not keep is another
# optimizer's.
ALL_MOMENTS = frozenset(key for kind in KINDS.values() for key, _ in kind.moments)


def read_slot(zoe_group, slot, count):
    """The first ``count`` elements of a zoe group's state slot as a fresh fp32 tensor."""
    values = torch.empty(count, dtype=torch.float32)
    zoe_group.read_state(slot, 0, count, values.data_ptr())
    return values


def unstepped_entry(kind, shape):
    """The state of a parameter of ``shape`` never stepped: None, as torch keeps none, or for a
    kind whose torch optimizer keeps state from construction (Adagrad) step 0 and zero
    moments."""
    if not kind.state_from_start:
        return None
    entry = {"step": torch.tensor(0.0)}
    entry.update((key, torch.zeros(shape, dtype=torch.float32)) for key, _ in kind.moments)
    return entry


def param_entries(kind, params, slots, steps):
    """[per-parameter state dict or None] of a param group of an optimizer of ``kind`` from its
    flat ``slots`` (torch's name -> the group's values) and per-parameter step counts: a
    parameter never stepped has unstepped_entry(); 'master_param' only for a parameter that is
    not fp32."""
    result, offset = [], 0
    for param, step in zip(params, steps):
        n = param.numel()
        if step == 0:
            result.append(unstepped_entry(kind, param.shape))
            offset += n
            continue
        entry = {"step": torch.tensor(float(step))}
        for key, values in slots.items():
            if key != "master_param" or param.dtype != torch.float32:
                entry[key] = values[offset : offset + n].view_as(param).clone()
        result.append(entry)
        offset += n
    return result


def packed_state_dict(param_groups, group_entries):
    """torch's state dict of ``param_groups`` with the parameters numbered in order, from each
    group's [per-parameter state dict or None] (``group_entries``, in the groups' order)."""
    packed_groups, state, next_index = [], {}, 0
    for group, entries in zip(param_groups, group_entries):
        params = group["params"]
        packed = {key: value for key, value in group.items() if key != "params"}
        packed["params"] = list(range(next_index, next_index + len(params)))
        packed_groups.append(packed)
        for offset, entry in enumerate(entries):
            if entry is not None:
                state[next_index + offset] = entry
        next_index += len(params)
    return {"state": state, "param_groups": packed_groups}


def check_group_counts(param_groups, saved_groups):
    """ValueError (torch's messages) when a state dict's groups do not match the optimizer's
    in number or in their parameter counts."""
    if len(param_groups) != len(saved_groups):
        raise ValueError("loaded state dict has a different number of parameter groups")
    for group, saved in zip(param_groups, saved_groups):
        if len(group["params"]) != len(saved["params"]):
            raise ValueError(
                "loaded state dict contains a parameter group that doesn't match the size "
                "of optimizer's group"
            )


def checked_param_state(kind, group_index, index, param, param_state):
    """A copy of one parameter's saved state for an optimizer of ``kind``, checked to be one zoe
    can load into ``param`` (ValueError or InvalidArgument otherwise); None for no state."""
    if not param_state:
        return None
    where = f"state of parameter {index} of param group {group_index}"
    moments = [key for key, _ in kind.moments]
    for key in ["step"] + moments:
        if key not in param_state:
            raise ValueError(f"{where} lacks {key!r}; a zoe.torch.{kind.name} state holds "
                             f"{', '.join(['step'] + moments)}")
    if "max_exp_avg_sq" in param_state:
        raise _invalid(f"{where} holds max_exp_avg_sq (amsgrad), which zoe optimizers do "
                       "not keep")
    foreign = sorted(set(param_state) & (ALL_MOMENTS - set(moments)))
    if foreign:
        raise _invalid(f"{where} holds {foreign[0]!r}, which zoe.torch.{kind.name} does not "
                       "keep: the state dict is another optimizer's")
    for key in moments + ["master_param"]:
        if key in param_state and param_state[key].shape != param.shape:
            raise ValueError(
                f"{where}: {key} has shape {tuple(param_state[key].shape)}, the parameter "
                f"{tuple(param.shape)}{_shard_hint(param)}"
            )
    # A copy, as torch's load_state_dict takes one: the state may be applied at the group's
    # first step, after the optimizer it came from has updated its tensors in place.
    return {
        key: value.detach().clone() if isinstance(value, torch.Tensor) else value
        for key, value in param_state.items()
    }


def _shard_hint(param):
    """What to do when a state of another shape meets ``param``, a ZeRO stage 3 shard over
    several ranks; empty for any other parameter."""
    pager = sharded_pager_of(param)
    if pager is None or pager.world_size == 1:
        return ""
    return (f" (this rank's shard of a ZeRO stage 3 parameter over {pager.world_size} ranks: "
            "a stage 3 optimizer over several ranks loads its own sharded saves only; a state "
            "dict of full parameters, such as consolidate_checkpoint's, loads at stage 1 or 2 "
            "on any number of ranks, or in one process at any stage)")


def saved_master(param, entry):
    """The fp32 master a parameter's saved state holds, taken only while it still rounds to the
    parameter (else the parameter was changed after the state was saved, and the parameter
    wins); None for an fp32 parameter or none saved."""
    master = entry.get("master_param")
    if master is None or param.dtype == torch.float32:
        return None
    master = master.to(torch.float32)
    return master if torch.equal(master.to(param.dtype), _current_values(param)) else None


def write_slots(kind, target, params, per_param):
    """Writes a param group's loaded state (per parameter: a checked state dict or None for
    zero moments) into ``target``'s slots (a zoe group, or zero.ShardSlice: the rank's part of
    it), the moments of optimizer ``kind``. The master is the saved one where saved_master()
    takes it, else the parameter's values; a zero-copy group (master_in_params) keeps its
    parameters as the master."""
    count = sum(param.numel() for param in params)
    moments = {key: torch.zeros(count, dtype=torch.float32) for key, _ in kind.moments}
    master = torch.empty(count, dtype=torch.float32)
    offset = 0
    for param, entry in zip(params, per_param):
        n = param.numel()
        if entry is not None:
            for key, values in moments.items():
                values[offset : offset + n] = entry[key].reshape(-1).to(torch.float32)
        saved = saved_master(param, entry) if entry is not None else None
        source = saved if saved is not None else _current_values(param)
        master[offset : offset + n] = source.reshape(-1).to(torch.float32)
        offset += n
    slots = [(slot, moments[key]) for key, slot in kind.moments]
    if not getattr(target, "master_in_params", False):
        slots.append((_capi.StateSlot.MASTER, master))
    for slot, values in slots:
        target.write_state(slot, 0, count, values.data_ptr())


def loaded_steps(per_param):
    """One step count per parameter, as torch keeps them; a parameter without state (never
    stepped) starts again from 0 with zero moments."""
    return [0 if entry is None else int(float(entry["step"])) for entry in per_param]
