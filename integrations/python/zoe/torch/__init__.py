"""PyTorch integration: offloaded optimizers and ZeRO-3-style parameter paging.

``zoe.torch.AdamW``, ``Adam``, ``Adagrad`` and ``Lion`` are ``torch.optim.Optimizer`` subclasses
whose state (fp32 master weights and the optimizer's moments) lives in a zoe engine, in pinned DRAM
or on NVMe as the engine's configuration says. Each param group is one zoe optimizer group: the
group's parameters, concatenated in order, are its elements, and a step hands zoe one buffer view
per parameter (gradients in, updated parameters out, in the parameters' own dtype).

Parameters may live on a CUDA device (one per param group): gradients are copied to the host as
they become final in backward (``with optimizer.overlap():`` around the backward that ends an
accumulation) and the updated parameters copied back on a side stream. ``HostTwin`` is the CPU
twin of a device (``device_backend=zoe.torch.HostTwin(adversarial=True)``) that runs the same
path in tests.

``offload_parameters(model, engine)`` pages a module's parameters through the engine (see its
docstring); ``ParameterPager`` is the handle it returns. With ``process_group=pg`` it is ZeRO
stage 3 across the group's ranks and returns a ``ShardedParameterPager`` (docs/zero3.md).
``with zero_init(engine): model = build()`` pages each parameter as its module is constructed,
so the model never exists whole in DRAM; offload_parameters then adopts them (paged_init.py).
``consolidate_checkpoint(directory, out_path)`` turns a sharded optimizer checkpoint into one
state dict file without the ranks (consolidate.py).
``with offload_activations(engine, device="nvme"):`` around a forward moves the tensors autograd
saves for backward to pinned DRAM or NVMe and brings them back for backward (activations.py,
activation_store.py); ``checkpoint(function, *args)`` is torch.utils.checkpoint with its saved
inputs offloaded (activation_checkpoint.py, docs/activation-offload.md).

Only ``zoe.torch`` needs torch; ``import zoe`` does not import it.

The package, by concern: optimizer.py (AdamW, Adam, Adagrad, Lion, each an OptimizerKind of
optim_kinds.py; one GroupState per param group, param_group.py), config.py (engine_config and the
optimizer's configuration), state_layout.py (torch's state dict layout), device.py (the device
path: DeviceBackend, CudaBackend, HostTwin, its waits), grad_hooks.py (gradient hooks, ZeRO
buckets), grad_stream.py (gradients of paged parameters streamed out of backward into stores,
stepped window by window), zero.py (ZeRO stages 1 and 2: the optimizer's ZeroPartition),
distributed.py (collectives, the shard formula, sharded groups), checkpoint.py (sharded
checkpoints), paging.py (ParameterPager), zero3.py (ZeRO stage 3: ShardedParameterPager),
offload.py (offload_parameters), paged_init.py and adoption.py (zero_init; parameters it paged
adopted by the pagers), stage3_checks.py (stage 3 misuses refused), activations.py and
activation_store.py (offload_activations), activation_checkpoint.py (checkpoint, the
activation_checkpointing section), ds_*.py (initialize and its engine), consolidate.py, common.py.
"""

from . import checkpoint as _sharded_checkpoints
from .activation_checkpoint import checkpoint_profile, configure_checkpointing, reset_checkpointing
from .activation_checkpoint import checkpoint as _checkpoint
from .activations import ActivationOffload, offload_activations
from .config import engine_config
from .consolidate import consolidate_checkpoint, consolidated_state_dict
from .device import CudaBackend, DeviceBackend, HostTwin
from .ds_initialize import initialize
from .offload import offload_parameters
from .optimizer import Adagrad, Adam, AdamW, Lion
from .paging import ParameterPager
from .zero3 import ShardedParameterPager
from .paged_init import ZeroInit, zero_init


class _CallableModule(type(_sharded_checkpoints)):
    """``zoe.torch.checkpoint`` is both the module of sharded checkpoints (checkpoint.py, its
    names as before) and, called, activation checkpointing: ``zoe.torch.checkpoint(function,
    *args)`` (activation_checkpoint.checkpoint)."""

    def __call__(self, function, *args, **kwargs):
        return _checkpoint(function, *args, **kwargs)


_sharded_checkpoints.__class__ = _CallableModule
checkpoint = _sharded_checkpoints

__all__ = [
    "ActivationOffload",
    "Adagrad",
    "Adam",
    "AdamW",
    "CudaBackend",
    "DeviceBackend",
    "HostTwin",
    "Lion",
    "ParameterPager",
    "ShardedParameterPager",
    "ZeroInit",
    "checkpoint",
    "checkpoint_profile",
    "configure_checkpointing",
    "consolidate_checkpoint",
    "consolidated_state_dict",
    "engine_config",
    "initialize",
    "offload_activations",
    "offload_parameters",
    "reset_checkpointing",
    "zero_init",
]
