"""What DeepSpeedEngine.load_checkpoint checks before it changes anything: the save's files
against their checksum record (ds_checksums.py), model_states.pt readable and of zoe's engine, the
optimizer's state of this engine's kind and saved in the layout it loads (one copy, or sharded
over the same ranks at a stage of the same sharding), a torch optimizer's param groups, and the
schedule and loss scale loadable (tried, then put back). The functions here read and compare;
none changes the engine."""

import copy
import dataclasses
import os
import pickle
import zipfile
from typing import Any, Optional

import torch

from .. import _capi
from ..errors import Corruption, FailedPrecondition, InvalidArgument, NotFound
from .checkpoint import MANIFEST, PARAM_GROUPS, read_manifest
from .ds_checkpoint import MODEL_STATES

OPTIMIZER_DIR = "optimizer"
TORCH_OPTIMIZER = "optimizer.pt"
COUNTERS = ("global_steps", "global_samples", "micro_steps", "skipped_steps")
_ENGINE_KEYS = ("module", "client_state") + COUNTERS
# what torch.load raises for a file that is not what torch.save wrote
_DAMAGED = (RuntimeError, EOFError, ValueError, pickle.UnpicklingError, zipfile.BadZipFile)


@dataclasses.dataclass
class LoadPlan:
    """What one load_checkpoint call loads."""
    strict: bool
    optimizer: bool  # the optimizer's state
    rest: bool  # the schedule, the loss scale and the counters (not load_module_only)
    schedule: bool  # load_lr_scheduler_states
    custom_load_fn: Any = None


@dataclasses.dataclass
class Checked:
    """A save checked for a load: model_states.pt's dict, and a torch optimizer's state."""
    state: dict
    torch_optimizer: Optional[dict] = None


def load_saved(path):
    """torch.load of a file this engine saved (client state may hold any picklable object:
    torch 2.6 and later load only tensors and plain types unless told otherwise)."""
    try:
        return torch.load(path, weights_only=False)
    except TypeError:  # a torch without the weights_only argument
        return torch.load(path)


def read_saved(path, what):
    """load_saved, a missing file NotFound and a damaged one Corruption, naming it."""
    if not os.path.isfile(path):
        raise NotFound(_capi.Status.NOT_FOUND, f"{path!r} is missing: the save holds no {what}")
    try:
        return load_saved(path)
    except _DAMAGED as error:
        raise Corruption(_capi.Status.CORRUPTION,
                         f"{path!r} is not a file torch.save wrote ({type(error).__name__}: "
                         f"{error}): it is truncated or damaged; load another tag") from None


def read_model_states(path):
    """The dict of ``<path>/model_states.pt``, checked to be one zoe's engine saved."""
    file = os.path.join(path, MODEL_STATES)
    state = read_saved(file, "module state")
    missing = ([key for key in _ENGINE_KEYS if key not in state]
               if isinstance(state, dict) else list(_ENGINE_KEYS))
    if missing:
        raise Corruption(_capi.Status.CORRUPTION,
                         f"{file!r} is not the state zoe's engine saves (no {missing[0]!r})")
    return state


def saved_sharding(path):
    """How the save in ``path`` holds its optimizer: ("torch", None) for a torch optimizer's
    optimizer.pt, ("zoe", None) for one copy of a zoe optimizer, ("zoe", (3 or 1, world size))
    for zoe's sharded checkpoint of stage 3 or of stages 1 and 2 (which share their layout).
    NotFound when it holds none."""
    directory = os.path.join(path, OPTIMIZER_DIR)
    if os.path.isfile(os.path.join(directory, MANIFEST)):
        manifest = read_manifest(directory)
        return "zoe", (3 if manifest.get("zero_stage") == 3 else 1, manifest["world_size"])
    if os.path.isfile(os.path.join(directory, PARAM_GROUPS)):
        return "zoe", None
    if os.path.isfile(os.path.join(path, TORCH_OPTIMIZER)):
        return "torch", None
    raise NotFound(_capi.Status.NOT_FOUND,
                   f"{path!r} holds no optimizer state (neither {OPTIMIZER_DIR}/ of a zoe "
                   f"optimizer nor {TORCH_OPTIMIZER} of a torch one): load it with "
                   "load_optimizer_states=False")


def _held(sharding):
    if sharding is None:
        return "one copy"
    stage, world = sharding
    return f"sharded over {world} ranks at stage {3 if stage == 3 else '1 or 2'}"


def _ranks(world):
    return f"{world} rank" + ("" if world == 1 else "s")


def check_kind(path, saved_kind, optimizer, is_zoe):
    """InvalidArgument when the save holds another kind of optimizer than ``optimizer``."""
    if (saved_kind == "zoe") == is_zoe:
        return
    held = ("a zoe.torch optimizer's state" if saved_kind == "zoe"
            else f"a torch optimizer's state ({TORCH_OPTIMIZER})")
    raise InvalidArgument(_capi.Status.INVALID_ARGUMENT,
                          f"the checkpoint {path!r} holds {held}; this engine's optimizer is "
                          f"{type(optimizer).__module__}.{type(optimizer).__name__}: load it "
                          "with load_optimizer_states=False (the module, schedule and counters)")


def check_sharding(path, state, saved, mine):
    """FailedPrecondition naming both and the fix when the save's optimizer is held as
    ``saved`` (saved_sharding's) and this engine's as ``mine``, and those differ; ``mine``
    is (stage, world size, sharding)."""
    stage, world, sharding = mine
    if saved == sharding:
        return
    directory = os.path.join(path, OPTIMIZER_DIR)
    if saved is None:
        fix = ("load it where the optimizer is one copy (one process, or stage 0 on any number "
               "of ranks), or the module alone (load_module_only=True); to keep the optimizer "
               "state at stage 1 or 2 over ranks, load it in one process, torch.save its "
               "optimizer.state_dict(), and give that to optimizer.load_state_dict on the ranks")
    else:
        fix = (f"load it on {_ranks(saved[1])} at stage {3 if saved[0] == 3 else '1 or 2'}, or "
               "the module alone (load_module_only=True), or turn its optimizer state into "
               f"one state dict with zoe.torch.consolidate_checkpoint({directory!r}, out_path) "
               "and give it (a stage 3 save: its 'optimizer') to optimizer.load_state_dict at "
               "stage 1 or 2 on any number of ranks, or in one process at any stage")
    raise FailedPrecondition(
        _capi.Status.FAILED_PRECONDITION,
        f"the checkpoint {path!r} was saved at ZeRO stage {state.get('zero_stage')} on "
        f"{_ranks(state.get('world_size', 1))}, its optimizer state {_held(saved)}; this "
        f"engine is stage {stage} on {_ranks(world)}, its optimizer state {_held(sharding)}: "
        f"{fix}")


def torch_optimizer_state(path, optimizer):
    """A torch optimizer's saved state dict, checked to have ``optimizer``'s param groups
    (torch's load_state_dict would refuse it after nothing else)."""
    file = os.path.join(path, TORCH_OPTIMIZER)
    saved = read_saved(file, "optimizer state")
    sizes = [len(group["params"]) for group in optimizer.param_groups]
    try:
        saved_sizes = [len(group["params"]) for group in saved["param_groups"]]
    except (KeyError, TypeError) as error:
        raise Corruption(_capi.Status.CORRUPTION,
                         f"{file!r} is not an optimizer's state dict (no {error})") from None
    if saved_sizes != sizes:
        raise InvalidArgument(_capi.Status.INVALID_ARGUMENT,
                              f"{file!r} holds param groups of {saved_sizes} parameters; this "
                              f"optimizer's have {sizes}: load it with load_optimizer_states="
                              "False")
    return saved


def check_loadable(target, saved, what, fix, state_of=None):
    """InvalidArgument naming ``what`` and ``fix`` when ``target.load_state_dict(saved)``
    fails; tried on ``target`` and put back as it was either way (its state as ``state_of``
    gives it, by default ``target.state_dict()``)."""
    before = copy.deepcopy(state_of(target) if state_of is not None else target.state_dict())
    try:
        target.load_state_dict(copy.deepcopy(saved))
    except Exception as error:  # any failure of the state's own loader refuses it
        raise InvalidArgument(_capi.Status.INVALID_ARGUMENT,
                              f"{what} ({type(target).__name__}) cannot take the saved state "
                              f"({type(error).__name__}: {error}): {fix}") from None
    finally:
        target.load_state_dict(before)
