"""zoe optimizer state in torch's Adam/AdamW layout (what state_dict() returns and
load_state_dict() takes): per parameter 'step' (a float32 scalar tensor), 'exp_avg' and
'exp_avg_sq' (float32, the parameter's shape), plus 'master_param' for bfloat16 and float16
parameters (the fp32 master weights). The unsharded optimizer and the ZeRO one (zero.py) both
build and read it here; a zoe group holds a param group's parameters concatenated, so a slot of
the group is one flat fp32 tensor that these functions cut per parameter."""

import torch

from .. import _capi
from .common import _current_values, _invalid

# The zoe state slots in torch's names ('master_param' only for parameters that are not fp32).
SLOTS = (("exp_avg", _capi.StateSlot.EXP_AVG), ("exp_avg_sq", _capi.StateSlot.EXP_AVG_SQ),
         ("master_param", _capi.StateSlot.MASTER))


def read_slot(zoe_group, slot, count):
    """The first ``count`` elements of a zoe group's state slot as a fresh fp32 tensor."""
    values = torch.empty(count, dtype=torch.float32)
    zoe_group.read_state(slot, 0, count, values.data_ptr())
    return values


def param_entries(params, slots, steps):
    """[per-parameter state dict or None] of a param group from its flat ``slots`` (torch's
    name -> the group's values) and per-parameter step counts: None for a parameter never
    stepped (torch keeps no state for it either); 'master_param' only for a parameter that is
    not fp32."""
    result, offset = [], 0
    for param, step in zip(params, steps):
        n = param.numel()
        if step == 0:
            result.append(None)
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


def checked_param_state(group_index, index, param, param_state):
    """A copy of one parameter's saved state, checked to be one zoe can load into ``param``
    (ValueError or InvalidArgument otherwise); None for no state."""
    if not param_state:
        return None
    where = f"state of parameter {index} of param group {group_index}"
    for key in ("step", "exp_avg", "exp_avg_sq"):
        if key not in param_state:
            raise ValueError(f"{where} lacks {key!r}")
    if "max_exp_avg_sq" in param_state:
        raise _invalid(f"{where} holds max_exp_avg_sq (amsgrad), which zoe optimizers do "
                       "not keep")
    for key in ("exp_avg", "exp_avg_sq", "master_param"):
        if key in param_state and param_state[key].shape != param.shape:
            raise ValueError(
                f"{where}: {key} has shape {tuple(param_state[key].shape)}, the parameter "
                f"{tuple(param.shape)}"
            )
    # A copy, as torch's load_state_dict takes one: the state may be applied at the group's
    # first step, after the optimizer it came from has updated its tensors in place.
    return {
        key: value.detach().clone() if isinstance(value, torch.Tensor) else value
        for key, value in param_state.items()
    }


def saved_master(param, entry):
    """The fp32 master a parameter's saved state holds, taken only while it still rounds to the
    parameter (else the parameter was changed after the state was saved, and the parameter
    wins); None for an fp32 parameter or none saved."""
    master = entry.get("master_param")
    if master is None or param.dtype == torch.float32:
        return None
    master = master.to(torch.float32)
    return master if torch.equal(master.to(param.dtype), _current_values(param)) else None


def write_slots(target, params, per_param):
    """Writes a param group's loaded state (per parameter: a checked state dict or None for
    zero moments) into ``target``'s slots (a zoe group, or zero.ShardSlice: the rank's part of
    it). The master is the saved one where saved_master() takes it, else the parameter's
    values; a zero-copy group (master_in_params) keeps its parameters as the master."""
    count = sum(param.numel() for param in params)
    exp_avg = torch.zeros(count, dtype=torch.float32)
    exp_avg_sq = torch.zeros(count, dtype=torch.float32)
    master = torch.empty(count, dtype=torch.float32)
    offset = 0
    for param, entry in zip(params, per_param):
        n = param.numel()
        if entry is not None:
            exp_avg[offset : offset + n] = entry["exp_avg"].reshape(-1).to(torch.float32)
            exp_avg_sq[offset : offset + n] = entry["exp_avg_sq"].reshape(-1).float()
        saved = saved_master(param, entry) if entry is not None else None
        source = saved if saved is not None else _current_values(param)
        master[offset : offset + n] = source.reshape(-1).to(torch.float32)
        offset += n
    slots = [(_capi.StateSlot.EXP_AVG, exp_avg), (_capi.StateSlot.EXP_AVG_SQ, exp_avg_sq)]
    if not getattr(target, "master_in_params", False):
        slots.append((_capi.StateSlot.MASTER, master))
    for slot, values in slots:
        target.write_state(slot, 0, count, values.data_ptr())


def loaded_steps(per_param):
    """One step count per parameter, as torch keeps them; a parameter without state (never
    stepped) starts again from 0 with zero moments."""
    return [0 if entry is None else int(float(entry["step"])) for entry in per_param]
