"""GroupState: everything a zoe optimizer keeps for one torch param group, in one object (the zoe
group, the device path, zero copy's masters, the parameters' version counters, a loaded state
waiting for the zoe group, the latest step's result, under ZeRO stages 1 and 2 the rank's shard,
and for paged parameters their streamed gradients). The optimizer holds one per entry of
``param_groups``, in the same order."""

import dataclasses
from typing import Any, List, Optional

from ..engine import StepResult
from .common import _pager_of


@dataclasses.dataclass(eq=False)
class GroupState:
    """One param group's zoe state. ``group`` is the torch param group dict, borrowed from
    ``optimizer.param_groups`` (its "params" and hyper-parameters are read from there, so a
    change made through param_groups is seen here)."""

    index: int  # the param group's position in optimizer.param_groups
    group: dict
    # device.DeviceGroup when the group steps on a device (or the CPU twin), else None
    device: Any = None
    # the zoe OptimizerGroup (under ZeRO, this rank's part of the sharded group); None until the
    # group's first use, which creates it from the parameters' values then
    zoe_group: Any = None
    # zero copy: the parameters' tensors whose storage is the master (kept alive here), else None
    masters: Optional[List[Any]] = None
    # per parameter: its version counter after zoe last wrote it (None: paged), None before
    versions: Optional[List[Optional[int]]] = None
    # a loaded per-parameter state (load_state_dict) to apply once zoe_group is created
    pending: Optional[List[Optional[dict]]] = None
    # the StepResult of the group's latest step; None when it had no gradient (or no step yet)
    last_step: Optional[StepResult] = None
    # zero.GroupShard under ZeRO stages 1 and 2 (the sharded group, buckets, gradient buffer)
    shard: Any = None
    # grad_stream.GradStream when the group holds paged parameters (their gradients streamed
    # out of backward), else None
    stream: Any = None
    # the global norm of a streamed group's gradients, taken before its step (every rank of a
    # sharded pager together), else None
    stream_norm: Any = None
    # the values of the kind's creation_keys when zoe created zoe_group (optim_kinds.py)
    creation_values: Optional[tuple] = None

    @property
    def params(self):
        """The group's parameters (the torch param group's list)."""
        return self.group["params"]

    @property
    def zero_copy(self):
        """Whether the parameters are the group's master (see optimizer.py, "Zero copy")."""
        return self.masters is not None

    def element_count(self):
        """The group's elements: its parameters' sizes summed."""
        return sum(param.numel() for param in self.params)

    def offsets(self):
        """Per parameter, its first element in the group's concatenation."""
        offsets, offset = [], 0
        for param in self.params:
            offsets.append(offset)
            offset += param.numel()
        return offsets

    def record_versions(self):
        """Remembers the parameters' version counters (after zoe wrote them), by which a later
        write from outside the optimizer is seen (paged parameters have none)."""
        self.versions = [None if _pager_of(param) else param._version for param in self.params]
