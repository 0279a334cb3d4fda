"""Where a sharded param group's gradients are reduced and its parameters gathered (zero.py's
ZeRO stages 1 and 2): ``HostPlace`` for CPU parameters, ``DevicePlace`` for parameters on a device
(a CUDA GPU, or the CPU twin standing in for one) -- ZeRO-Offload's data path across ranks.

A place gives zero.ZeroPartition, per param group (GroupShard.place):

- ``bucket_buffer(state, begin, end, make_room)``: the fp32 buffer, beside the parameters, that
  a bucket's gradients (elements [begin, end) of the group) are flattened into and summed in
  place by the bucket's reduction (``make_room()`` finishes the oldest reduction in flight);
- ``to_host(part, at, sharded)``: the host fp32 memory zoe reads this rank's averaged part of a
  reduced bucket from, until the step (``at``: its first element within the shard);
  ``release(flat)`` once the bucket's buffer may be reused; ``take_failure()``: a copy of them
  that failed, which ZeroPartition agrees over the ranks before any group steps;
- ``prepare(state, comm, bucket_sizes, slots)``: what the group needs, before its state is
  created (every rank together, agreed);
- ``step(state, hyper, params, comm)``: zoe's sharded step, then every rank's updated
  parameters in ``params``.

HostPlace: one flat fp32 gradient buffer per group in DRAM (made once, again only when the group's
element count changes), which zoe borrows slices of until the step (no copy); zoe's sharded step
gathers the updated parameters straight into the parameters (broadcast over gloo).

DevicePlace: this rank keeps in pinned DRAM (one zoe tensor homed in HOST) only its shard's fp32
gradients and updated parameters, 8 bytes per element of the shard. On the device, shared by the
optimizer's groups (DeviceBuffers): bucket buffers for the largest buckets that can be in flight
at once, and at the step the shard and one round of the gather.

- A bucket is summed on the device (NCCL; gloo over the twin's CPU tensors). This rank's part,
  averaged, is copied device -> host into the shard's gradient staging and handed to zoe once the
  copy has ended, which frees the bucket's buffer.
- The step: zoe's sharded step with views of this rank's shard only (the inf/NaN skip and the
  clipping agreed over the ranks as for CPU parameters) writes the shard's updated values into
  its parameter staging; they are copied host -> device and all-gathered on the device, in rounds
  of ``round_elements`` per rank, into every rank's parameters that had a gradient on some rank
  (the others are left as they are, as torch leaves them).
- Failures are agreed, so that no rank waits for a collective a peer never makes: a gradient copy
  that fails (during backward or at step()) makes every rank raise before any group steps, naming
  the rank (the optimizer then drops the iteration: ZeroPartition.abandon_iteration). A failed
  host -> device copy of the updated shard makes every rank raise before the gather: zoe took the
  step, the device parameters are as before it.

Each wait on a copy goes through device._wait by a name of device.WAITS ("shard_grad",
"shard_params"), so that the adversarial twin's tests cover it."""

import bisect

import torch

from .. import _capi
from ..engine import BufferView
from .common import _invalid, _view, check_nccl_device
from .device import _aligned, _device_call, _wait, host_staging
from .distributed import shard_boundaries, shard_counts

_FLOAT32 = _capi.DType.FLOAT32


class HostPlace:
    """CPU parameters: the group's flat fp32 gradient buffer, borrowed by zoe (no copy)."""

    def __init__(self):
        self.buffer = None  # the flat fp32 gradient buffer of the group
        self.grads = []  # slices of it zoe borrows until the step

    def prepare(self, state, comm, bucket_sizes, slots):
        del state, comm, bucket_sizes, slots  # the buffer is made at first use

    def bucket_buffer(self, state, begin, end, make_room):
        """Elements [begin, end) of the group's gradient buffer: allocated once, again only when
        the group's element count changes."""
        del make_room  # every bucket has its own place in it
        count = state.element_count()
        if self.buffer is None or self.buffer.numel() != count:
            self.buffer = torch.empty(count, dtype=torch.float32)
        return self.buffer[begin:end]

    def to_host(self, part, at, sharded):
        del at, sharded  # zoe reads the part where it is: not written again before the step
        self.grads.append(part)
        return part

    @staticmethod
    def take_failure():
        return None  # nothing is copied

    def release(self, flat):
        del flat  # the slice stays the group's

    def step(self, state, hyper, params, comm, loss_scale=1.0):
        """The sharded step; zoe gathers every rank's parameters into ``params``."""
        del comm
        return state.shard.sharded.step(hyper, [_view(param) for param in params], loss_scale)

    def end_iteration(self):
        self.grads = []

    def close(self):
        self.grads = []


def check_transport(comm, device, group_index):
    """InvalidArgument unless ``comm`` (TorchCollectives) can reduce and gather tensors on
    ``device``, a param group's: CUDA parameters need a NCCL process group on the current CUDA
    device; CPU ones (the twin's), a CPU backend such as gloo."""
    if device.type == comm.device.type == "cuda":
        check_nccl_device(device, f"param group {group_index}", "before creating the optimizer")
    elif device.type != comm.device.type:
        wanted = "NCCL" if device.type == "cuda" else "a CPU backend (gloo)"
        raise _invalid(
            f"param group {group_index} is on {device}; its gradients are reduced and its "
            f"parameters gathered there, which needs a process group over {wanted}")


class DeviceBuffers:
    """The device buffers every device param group of one optimizer shares: bucket buffers
    (at most ReductionsInFlight's limit + 1 reductions are in flight, over every group) and one
    buffer per purpose of the step. Grow-only, reserved when a group is created (by every rank
    together, agreed), so that backward and the step allocate nothing a rank could fail to
    get while its peers wait in a collective."""

    def __init__(self):
        self._free = []  # bucket buffers not in use
        self._in_use = {}  # data_ptr -> bucket buffer handed out by take()
        self._step = {}  # (purpose, device) -> buffer of the step
        # device -> the sizes its bucket buffers must hold at once, largest first (the largest
        # buckets of every group, as many as can be in flight)
        self._required = {}
        self.unreserved = 0  # bucket buffers take() had to allocate beyond the reservation

    def reserve(self, device, bucket_sizes, slots, step_elements):
        """Bucket buffers on ``device`` that hold buckets of ``bucket_sizes`` at once (those
        held already count, largest for largest), at most ``slots`` of them kept (the largest:
        at most that many reductions are in flight over every group), and for each purpose of
        ``step_elements`` a buffer of that many elements."""
        required = sorted(self._required.get(device, []) + list(bucket_sizes), reverse=True)
        self._required[device] = required = required[:slots]
        held = self._largest_first(device)
        for index, size in enumerate(required):  # held[i] must hold the i-th largest bucket
            if index >= len(held) or held[index].numel() < size:
                buffer = torch.empty(size, dtype=torch.float32, device=device)
                self._free.append(buffer)
                held.insert(index, buffer)
        self._trim(device)
        for purpose, count in step_elements.items():
            self.step_buffer(purpose, count, device)

    def _largest_first(self, device):
        held = [b for b in self._free + list(self._in_use.values()) if b.device == device]
        return sorted(held, key=torch.Tensor.numel, reverse=True)

    def _trim(self, device):
        """Drops the free buffers on ``device`` that the largest-first match of the required
        sizes does not use (one in use goes when it is released)."""
        kept = {id(b) for b in self._largest_first(device)[: len(self._required.get(device, []))]}
        self._free = [b for b in self._free if b.device != device or id(b) in kept]

    def take(self, count, device, make_room):
        """A bucket buffer of ``count`` elements, in use until release(): the smallest free one
        that fits. When none does, ``make_room()`` (finishing the oldest reduction in flight,
        which releases its buffer: every rank does the same) until one does or it returns False;
        only then is one allocated beyond the reservation (counted in ``unreserved``)."""
        while True:
            fitting = [i for i, b in enumerate(self._free)
                       if b.device == device and b.numel() >= count]
            if fitting:
                buffer = self._free.pop(min(fitting, key=lambda i: self._free[i].numel()))
                break
            if not make_room():
                buffer = torch.empty(count, dtype=torch.float32, device=device)
                self.unreserved += 1
                break
        self._in_use[buffer.data_ptr()] = buffer
        return buffer[:count]

    def release(self, flat):
        buffer = self._in_use.pop(flat.data_ptr(), None)
        if buffer is not None:
            self._free.append(buffer)
            self._trim(buffer.device)

    def step_buffer(self, purpose, count, device):
        """``count`` elements of the step's buffer for ``purpose`` on ``device``."""
        key = (purpose, device)
        buffer = self._step.get(key)
        if buffer is None or buffer.numel() < count:
            buffer = torch.empty(count, dtype=torch.float32, device=device)
            self._step[key] = buffer
        return buffer[:count]


class DevicePlace:
    """Parameters on a device: see the module docstring."""

    def __init__(self, backend, engine, name, group_index, round_elements, buffers):
        self.backend = backend
        self.engine = engine
        self.name = name
        self.group_index = group_index
        self.round_elements = round_elements
        self.buffers = buffers  # DeviceBuffers, the optimizer's
        self._staging = None  # the zoe tensor over the shard's gradients and parameters
        self._grads = None  # fp32 CPU tensor over the shard's gradient staging
        self._params = None  # fp32 CPU tensor over the shard's parameter staging
        self._failure = None  # the first gradient copy that failed in this iteration

    @staticmethod
    def staging_bytes(shard_elements):
        """Bytes of HOST staging a shard of ``shard_elements`` needs: gradients and parameters."""
        return 2 * _aligned(4 * shard_elements)

    def prepare(self, state, comm, bucket_sizes, slots):
        """Before the group's sharded group is created (every rank, agreed): its staging, and
        the device buffers its reductions (``bucket_sizes``: of the buckets that can be in
        flight at once; ``slots``: how many can be, over every group) and steps use. Called
        again after a failure, it makes what is still missing."""
        if self._staging is None:
            count = shard_counts(state.element_count(), comm.world_size)[comm.rank]
            self._staging, raw = host_staging(self.engine, f"{self.name}.staging",
                                              self.staging_bytes(count), self.group_index)
            values = raw.view(torch.float32)
            self._grads = values[:count]
            self._params = values[_aligned(4 * count) // 4:][:count]
        largest_shard = max(shard_counts(state.element_count(), comm.world_size))
        piece = self._piece(largest_shard)
        self.buffers.reserve(state.params[0].device, bucket_sizes, slots,
                             {"shard": largest_shard, "gather": piece * comm.world_size})
        comm.reserve_gather(piece)

    def _piece(self, largest_shard):
        """Elements each rank contributes to a round of the parameters' gather."""
        return max(1, min(self.round_elements, largest_shard))

    # --- gradients --------------------------------------------------------------------------

    def bucket_buffer(self, state, begin, end, make_room):
        """A device buffer of end - begin fp32 elements, the bucket's until release()
        (DeviceBuffers.take)."""
        return self.buffers.take(end - begin, state.params[0].device, make_room)

    def release(self, flat):
        self.buffers.release(flat)

    def to_host(self, part, at, sharded):
        """Copies a reduced part device -> host into the shard's gradient staging at ``at`` and
        returns it once the copy has ended. A copy that fails is kept for take_failure(), which
        the optimizer agrees over the ranks before any group steps; this rank goes on with the
        collectives of backward, as its peers do."""
        del sharded  # the staging was made for it (prepare)
        host = self._grads[at : at + part.numel()]
        try:
            with _device_call(f"param group {self.group_index}: the device -> host copy of a "
                              "reduced gradient failed",
                              "no rank took the step: run the iteration again"):
                event = self.backend.copy_to_host(part, host)
                _wait(self.backend, event, "shard_grad")
        except Exception as error:  # agreed before the step: the peers go on with backward
            self._failure = self._failure or error
        return host

    def take_failure(self):
        """The first gradient copy that failed since the last call, or None."""
        failure, self._failure = self._failure, None
        return failure

    # --- the step ---------------------------------------------------------------------------

    def step(self, state, hyper, params, comm, loss_scale=1.0):
        """zoe's step of the shard into its staging; then the updated shard's copy to the
        device, agreed over the ranks (one rank failing it makes every rank raise before the
        gather), and every rank's updated shard gathered into ``params``."""
        sharded = state.shard.sharded
        result = sharded.step(hyper, [BufferView(self._params.data_ptr(), _FLOAT32,
                                                 self._params.numel())], loss_scale)
        if result.skipped:
            return result
        device = params[0].device
        comm.agreed(f"param group {self.group_index}: the updated shard's copy to the device",
                    lambda: self._copy_shard_to_device(device))
        self._gather(state, params, comm)
        return result

    def _copy_shard_to_device(self, device):
        what = (f"param group {self.group_index}: the host -> device copy of the updated shard "
                "failed")
        consequence = ("zoe took the step on every rank and no rank's device parameters were "
                       "updated: load the latest checkpoint")
        shard = self.buffers.step_buffer("shard", self._params.numel(), device)
        with _device_call(what, consequence):
            event = self.backend.copy_to_device(self._params, shard)
            _wait(self.backend, event, "shard_params")

    def _gather(self, state, params, comm):
        """Every rank's updated shard all-gathered on the device, in rounds, into ``params``
        (those handed to zoe with a gradient: not state.shard.absent)."""
        total, world, device = state.element_count(), comm.world_size, params[0].device
        counts, begins = shard_counts(total, world), shard_boundaries(total, world)
        largest = max(counts)
        piece = self._piece(largest)
        shard = self.buffers.step_buffer("shard", counts[comm.rank], device)
        round_buffer = self.buffers.step_buffer("gather", piece * world, device)
        offsets = state.offsets()
        for first in range(0, largest, piece):
            round_counts = [max(0, min(piece, count - first)) for count in counts]
            mine = round_counts[comm.rank]
            gathered = comm.gather(shard[first : first + mine], round_counts,
                                   f"param group {state.index}'s updated parameters",
                                   out=round_buffer[: sum(round_counts)])
            at = 0
            for rank, count in enumerate(round_counts):
                _write_params(state, params, offsets, gathered[at : at + count],
                              begins[rank] + first)
                at += count

    def end_iteration(self):
        """After a step, taken or failed: a copy's failure not reported by a step that failed
        first is dropped with its step."""
        self._failure = None

    def close(self):
        """Releases the staging (every copy into or out of it was waited for)."""
        if self._staging is not None:
            try:
                self._staging.release()
            except Exception:  # the engine may be closed already
                pass
            self._staging = None


def _write_params(state, params, offsets, values, first):
    """``values``, elements [first, first + len) of the group, into the parameters they cover
    (each in its dtype), except those without a gradient on any rank; ``offsets``: the
    parameters' first elements, ascending."""
    end = first + values.numel()
    index = max(0, bisect.bisect_right(offsets, first) - 1)
    while index < len(params) and offsets[index] < end:
        param, offset = params[index], offsets[index]
        lo, hi = max(first, offset), min(end, offset + param.numel())
        if hi > lo and index not in state.shard.absent:
            # .data: the optimizer's own write does not count as a write from outside.
            param.data.view(-1)[lo - offset : hi - offset].copy_(values[lo - first : hi - first])
        index += 1
