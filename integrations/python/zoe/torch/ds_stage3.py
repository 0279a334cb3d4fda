"""ZeRO stage 3 under zoe.torch.initialize: the module's parameters paged through a zoe engine
(offload_parameters; homed in DRAM for offload_param "none"/"cpu", on NVMe for "nvme") and, over a
process group, partitioned across its ranks (a ShardedParameterPager, docs/zero3.md); the optimizer
(the config's zoe.torch optimizer on the same engine) steps this rank's shards, or the paged
parameters in one process. The gradients stream out of backward into the optimizer
(grad_stream.py), which clips them to gradient_clipping by the global norm over every rank's shards
and skips a non-finite step on every rank; under fp16 the engine takes that skip as the overflow
(every rank alike) and lowers the loss scale.

Stage3 holds the pager and the zoe engine, and does for the DeepSpeedEngine what paging changes:
the module's state dict (gathered), checkpoints (the pager's sharded ones over ranks) and
closing."""

import dataclasses
from typing import Any

from ..engine import Engine
from .._capi import Tier
from .ds_config import AUTO
from .offload import offload_parameters
from .optimizer import OPTIMIZERS
from .stage3_keep import (DEEPSPEED_MAX_LIVE_PARAMETERS, DEEPSPEED_MAX_REUSE_DISTANCE,
                          elements_setting)


@dataclasses.dataclass
class Stage3:
    """The paging side of a stage 3 engine (see the module docstring)."""
    pager: Any
    engine: Engine
    sharded: bool

    def module_state(self):
        """The module's state dict with its parameters' values (a collective when sharded)."""
        return self.pager.state_dict()

    def save(self, directory, optimizer, rank):
        """The optimizer and the parameters it steps: every rank its shards, or rank 0."""
        if self.sharded:
            self.pager.save_checkpoint(directory, optimizer)
        elif rank == 0:
            optimizer.save_checkpoint(directory)

    def load(self, directory, optimizer):
        """Loads what save wrote; the parameters take the saved master weights."""
        if self.sharded:
            self.pager.load_checkpoint(directory, optimizer)
        else:
            optimizer.load_checkpoint(directory)

    def close(self, optimizer):
        """Gives the module ordinary parameters again (a collective when sharded), closes the
        optimizer and the engine."""
        self.pager.remove()
        optimizer.close()
        self.engine.close()


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


def stage3_setup(module, spec, document, training, group):
    """(Stage3, the optimizer) for ``module`` under the config's optimizer ``spec``."""
    engine = Engine(document)
    try:
        sharding = {} if group is None else keep_settings(
            document, _gathered_in_bytes(module, engine),
            max((param.element_size() for param in module.parameters()), default=4))
        if group is not None and training.reduce_bucket_size is not None:
            sharding["bucket_elements"] = training.reduce_bucket_size
        pager = offload_parameters(module, engine, home=_home(training), process_group=group,
                                   **sharding)
        params = pager.shard_parameters() if group is not None else list(module.parameters())
        optimizer = OPTIMIZERS[spec["type"]](params, **spec["params"], engine=engine,
                                             max_grad_norm=training.gradient_clipping)
    except BaseException:
        engine.close()
        raise
    return Stage3(pager, engine, group is not None), optimizer
