"""zoe.torch.checkpoint: torch.utils.checkpoint whose saved inputs are offloaded (DeepSpeed's
``checkpointing.checkpoint`` with ``cpu_checkpointing``), and the DeepSpeed configuration's
``activation_checkpointing`` section.

``configure_checkpointing(engine, deepspeed_config=...)`` (zoe.torch.initialize calls it) reads
the section and sets what ``checkpoint(function, *args)`` does: the segment's forward runs without
saving anything (torch's reentrant checkpoint) and the inputs it keeps for the recomputation are
moved out by an ActivationOffload (pinned DRAM for a model on a GPU, NVMe for one on the CPU).
Inside a ``with offload_activations(...)`` block of that same ActivationOffload the block's hooks
move them; otherwise each call is a block of its own.

The section's keys, each honoured or refused (the C++ engine accepts the section and ignores it:
activations are the framework's, so zoe.torch honours it):

- ``cpu_checkpointing``: true offloads the checkpoints' inputs; false recomputes without offload.
- ``partition_activations``: splits checkpoints across model-parallel ranks; zoe has no model
  parallelism, so true is refused (each data-parallel rank keeps, and offloads, its own).
- ``contiguous_memory_optimization``: zoe always packs offloaded checkpoints contiguously into
  buckets, so either value is accepted and the packing is the same.
- ``number_checkpoints``: DeepSpeed sizes its contiguous buffers by it; zoe sizes its buckets from
  the engine's chunk size instead. Accepted (a positive integer or null), not used.
- ``synchronize_checkpoint_boundary``: true waits for the device at the end of each checkpoint's
  forward (torch.cuda.synchronize, and the offload copies issued so far), as DeepSpeed does.
- ``profile``: true times each checkpoint's forward and recomputation (``checkpoint_profile()``).
"""

import dataclasses
import functools
import time
from typing import Optional

import torch
import torch.utils.checkpoint

from .activations import ActivationOffload
from .common import _invalid

_BOOL_KEYS = ("cpu_checkpointing", "partition_activations", "contiguous_memory_optimization",
              "synchronize_checkpoint_boundary", "profile")
_KEYS = _BOOL_KEYS + ("number_checkpoints",)


@dataclasses.dataclass(frozen=True)
class CheckpointingConfig:
    """DeepSpeed's activation_checkpointing section, checked (see the module docstring)."""
    cpu_checkpointing: bool = False
    partition_activations: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: Optional[int] = None
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False


def checkpointing_config(section):
    """The CheckpointingConfig of a DeepSpeed ``activation_checkpointing`` section (None: the
    defaults); InvalidArgument naming the key for an unknown key, a wrong type or a refused
    value."""
    section = {} if section is None else section
    if not isinstance(section, dict):
        raise _invalid(f"activation_checkpointing must be an object, not {section!r}")
    for key, value in section.items():
        if key not in _KEYS:
            raise _invalid(f"unknown key 'activation_checkpointing.{key}'; allowed: "
                           f"{', '.join(_KEYS)}")
        if key in _BOOL_KEYS and not isinstance(value, bool):
            raise _invalid(f"activation_checkpointing.{key}: expected true or false, got "
                           f"{value!r}")
    number = section.get("number_checkpoints")
    if number is not None and (isinstance(number, bool) or not isinstance(number, int)
                               or number < 1):
        raise _invalid(f"activation_checkpointing.number_checkpoints = {number!r} is not "
                       "allowed; a positive integer or null (zoe sizes its buffers itself)")
    if section.get("partition_activations"):
        raise _invalid(
            "activation_checkpointing.partition_activations = true splits checkpoints across "
            "model-parallel ranks; zoe runs without model parallelism: set it false (with "
            "cpu_checkpointing true zoe offloads each rank's checkpoints to pinned DRAM or "
            "NVMe instead)")
    return CheckpointingConfig(**section)


class _Checkpointing:
    """What checkpoint() does by default: set by configure_checkpointing."""

    def __init__(self):
        self.config = None  # CheckpointingConfig once configured
        self.offload = None  # the ActivationOffload, with cpu_checkpointing
        self.profile = {"calls": 0, "forward_seconds": 0.0, "recompute_seconds": 0.0}


_STATE = _Checkpointing()


def configure_checkpointing(engine=None, deepspeed_config=None, device="auto", min_bytes=1,
                            **offload_options):
    """Sets what ``checkpoint`` does: ``deepspeed_config`` is a DeepSpeed configuration (a dict,
    JSON text or path) whose ``activation_checkpointing`` section is read, or that section
    itself; None means cpu_checkpointing true. With cpu_checkpointing the inputs go to
    ``offload_activations(engine, device, min_bytes, **offload_options)``. Returns the
    CheckpointingConfig."""
    config = checkpointing_config(_section_of(deepspeed_config))
    offload = None
    if config.cpu_checkpointing:
        if engine is None:
            raise _invalid("activation_checkpointing.cpu_checkpointing needs a zoe engine to "
                           "offload to: configure_checkpointing(engine, ...)")
        offload = ActivationOffload(engine, device, min_bytes, **offload_options)
    _STATE.config, _STATE.offload = config, offload
    return config


def _section_of(deepspeed_config):
    if deepspeed_config is None:
        return {"cpu_checkpointing": True}
    if isinstance(deepspeed_config, dict) and not set(deepspeed_config) <= set(_KEYS):
        return deepspeed_config.get("activation_checkpointing", {})
    if isinstance(deepspeed_config, dict):
        return deepspeed_config
    from .ds_config import load_document

    return load_document(deepspeed_config).get("activation_checkpointing", {})


def checkpoint_profile():
    """With ``profile``: checkpoint calls, and the seconds spent in their forwards and in their
    recomputations during backward."""
    return dict(_STATE.profile)


def reset_checkpointing():
    """Forgets the configuration (checkpoint() then recomputes without offloading until
    configure_checkpointing)."""
    _STATE.config = _STATE.offload = None
    _STATE.profile = {"calls": 0, "forward_seconds": 0.0, "recompute_seconds": 0.0}


def forget_engine(engine):
    """Forgets the configuration when its offload goes through ``engine``, which is being
    closed: a later checkpoint() then recomputes without offloading until configured again
    (initialize does it from an activation_checkpointing section), rather than offloading into
    a closed engine."""
    if _STATE.offload is not None and _STATE.offload.engine is engine:
        reset_checkpointing()


def checkpoint(function, *args, offload=None, preserve_rng_state=True, **kwargs):
    """``function(*args, **kwargs)`` checkpointed: its forward saves nothing but its inputs,
    which are offloaded (``offload``: an ActivationOffload, default the configured one), and
    backward recomputes it. torch's reentrant checkpoint, on torch 1.x and 2.x alike. Before
    any configuration (configure_checkpointing, or initialize with an activation_checkpointing
    section) and without ``offload`` it recomputes without offloading, as DeepSpeed's
    checkpoint does before it is configured."""
    config = _STATE.config
    if config is None:
        config = CheckpointingConfig(cpu_checkpointing=offload is not None)
    offload = offload if offload is not None else _STATE.offload
    run = functools.partial(function, **kwargs) if kwargs else function
    if config.profile:
        run = _profiled(run)
    started = time.perf_counter()
    if offload is None or offload._active:
        out = _torch_checkpoint(run, args, preserve_rng_state)
    else:
        with offload:
            out = _torch_checkpoint(run, args, preserve_rng_state)
    if config.synchronize_checkpoint_boundary:
        _synchronize(offload)
    if config.profile:
        _STATE.profile["calls"] += 1
        _STATE.profile["forward_seconds"] += time.perf_counter() - started
    return out


def _torch_checkpoint(run, args, preserve_rng_state):
    return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=True,
                                             preserve_rng_state=preserve_rng_state)


def _profiled(function):
    """``function`` timing its calls under grad mode (the recomputations in backward)."""
    def timed(*args, **kwargs):
        if not torch.is_grad_enabled():
            return function(*args, **kwargs)
        started = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            _STATE.profile["recompute_seconds"] += time.perf_counter() - started
    return timed


def _synchronize(offload):
    """The end of a checkpoint's forward waits for the device and the offload's copies."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    if offload is not None:
        offload.wait_copies()
