"""Where a sharded param group's gradients are reduced and its parameters gathered (zero.py's
ZeRO stages 1 and 2): ``HostPlace`` for CPU parameters, ``DevicePlace`` for parameters on a device
(a CUDA GPU, or the CPU twin standing in for one) -- ZeRO-Offload's data path across ranks.

A place gives zero.ZeroPartition, per param group (GroupShard.place):

- ``bucket_buffer(state, begin, end)``: the fp32 buffer, beside the parameters, that a bucket's
  gradients (elements [begin, end) of the group) are flattened into and summed in place by the
  bucket's reduction;
- ``to_host(part, at, sharded)``: the host fp32 memory zoe reads this rank's averaged part of a
  reduced bucket from, until the step (``at``: its first element within the shard);
  ``release(flat)`` once the bucket's buffer may be reused;
- ``step(state, hyper, params, comm)``: zoe's sharded step, then every rank's updated
  parameters in ``params``.

HostPlace: one flat fp32 gradient buffer per group in DRAM (made once, again only when the group's
element count changes), which zoe borrows slices of until the step (no copy); zoe's sharded step
gathers the updated parameters straight into the parameters (broadcast over gloo).

DevicePlace: this rank keeps in pinned DRAM (one zoe tensor homed in HOST) only its shard's fp32
gradients and updated parameters, 8 bytes per element of the shard. On the device: a bucket
buffer per reduction in flight (reused), and at the step the shard and one round of the gather.

- A bucket is summed on the device (NCCL; gloo over the twin's CPU tensors). This rank's part,
  averaged, is copied device -> host into the shard's gradient staging and handed to zoe once the
  copy has ended, which frees the bucket's buffer.
- The step: zoe's sharded step with views of this rank's shard only (the inf/NaN skip and the
  clipping agreed over the ranks as for CPU parameters) writes the shard's updated values into
  its parameter staging; they are copied host -> device and all-gathered on the device, in rounds
  of ``round_elements`` per rank, into every rank's parameters that had a gradient on some rank
  (the others are left as they are, as torch leaves them).
- Failures are agreed, so that no rank waits for a collective a peer never makes: a gradient copy
  that fails (during backward or at step()) is handed to zoe as NaN, so every rank's step is
  skipped (zoe's agreed non-finite skip: nothing changes anywhere), and after the step every rank
  raises, naming the rank and the copy. A failed host -> device copy of the updated shard makes
  every rank raise before the gather: zoe took the step, the device parameters are as before it.

Each wait on a copy goes through device._wait by a name of device.WAITS ("shard_grad",
"shard_params"), so that the adversarial twin's tests cover it."""

import torch

from .. import _capi
from ..engine import BufferView
from .common import _view
from .device import _aligned, _device_call, _wait, host_staging
from .distributed import shard_boundaries, shard_counts

_FLOAT32 = _capi.DType.FLOAT32


class HostPlace:
    """CPU parameters: the group's flat fp32 gradient buffer, borrowed by zoe (no copy)."""

    def __init__(self):
        self.buffer = None  # the flat fp32 gradient buffer of the group
        self.grads = []  # slices of it zoe borrows until the step

    def bucket_buffer(self, state, begin, end):
        """Elements [begin, end) of the group's gradient buffer: allocated once, again only when
        the group's element count changes."""
        count = state.element_count()
        if self.buffer is None or self.buffer.numel() != count:
            self.buffer = torch.empty(count, dtype=torch.float32)
        return self.buffer[begin:end]

    def to_host(self, part, at, sharded):
        del at, sharded  # zoe reads the part where it is: not written again before the step
        self.grads.append(part)
        return part

    def release(self, flat):
        del flat  # the slice stays the group's

    def step(self, state, hyper, params, comm):
        """The sharded step; zoe gathers every rank's parameters into ``params``."""
        del comm
        return state.shard.sharded.step(hyper, [_view(param) for param in params])

    def end_iteration(self):
        self.grads = []

    def close(self):
        self.grads = []


class DevicePlace:
    """Parameters on a device: see the module docstring."""

    def __init__(self, backend, engine, name, group_index, round_elements):
        self.backend = backend
        self.engine = engine
        self.name = name
        self.group_index = group_index
        self.round_elements = round_elements
        self._staging = None  # the zoe tensor over the shard's gradients and parameters
        self._grads = None  # fp32 CPU tensor over the shard's gradient staging
        self._params = None  # fp32 CPU tensor over the shard's parameter staging
        self._free = []  # bucket buffers not in use
        self._in_use = {}  # data_ptr -> bucket buffer handed out by bucket_buffer
        self._buffers = {}  # purpose -> a reused fp32 device buffer of the step
        self._failure = None  # the first gradient copy that failed in this iteration

    @staticmethod
    def staging_bytes(shard_elements):
        """Bytes of HOST staging a shard of ``shard_elements`` needs: gradients and parameters."""
        return 2 * _aligned(4 * shard_elements)

    # --- staging and device buffers ---------------------------------------------------------

    def _ensure_staging(self, sharded):
        if self._staging is not None:
            return
        count = sharded.end - sharded.begin
        self._staging, raw = host_staging(self.engine, f"{self.name}.staging",
                                          self.staging_bytes(count), self.group_index)
        values = raw.view(torch.float32)
        self._grads = values[:count]
        self._params = values[_aligned(4 * count) // 4:][:count]

    def bucket_buffer(self, state, begin, end):
        """A device buffer of end - begin fp32 elements, the bucket's until release()."""
        count = end - begin
        fitting = [buffer for buffer in self._free if buffer.numel() >= count]
        if fitting:
            buffer = min(fitting, key=torch.Tensor.numel)
            self._free.remove(buffer)
        else:
            device = state.params[0].device
            buffer = torch.empty(count, dtype=torch.float32, device=device)
        self._in_use[buffer.data_ptr()] = buffer
        return buffer[:count]

    def release(self, flat):
        buffer = self._in_use.pop(flat.data_ptr(), None)
        if buffer is not None:
            self._free.append(buffer)

    def _buffer(self, purpose, count, device):
        """A reused fp32 device buffer of at least ``count`` elements for ``purpose``."""
        buffer = self._buffers.get(purpose)
        if buffer is None or buffer.numel() < count:
            buffer = torch.empty(count, dtype=torch.float32, device=device)
            self._buffers[purpose] = buffer
        return buffer[:count]

    # --- gradients --------------------------------------------------------------------------

    def to_host(self, part, at, sharded):
        """Copies a reduced part device -> host into the shard's gradient staging at ``at`` and
        returns it once the copy has ended. A copy that fails leaves NaN there instead (the
        step is skipped on every rank) and is reported by step()."""
        self._ensure_staging(sharded)
        host = self._grads[at : at + part.numel()]
        try:
            with _device_call(f"param group {self.group_index}: the device -> host copy of a "
                              "reduced gradient failed", "every rank skipped the step"):
                event = self.backend.copy_to_host(part, host)
                _wait(self.backend, event, "shard_grad")
        except Exception as error:  # agreed at step(): the peers go on with their collectives
            host.fill_(float("nan"))
            self._failure = self._failure or error
        return host

    # --- the step ---------------------------------------------------------------------------

    def step(self, state, hyper, params, comm):
        """zoe's step of the shard into its staging; then, agreed over the ranks, the failures
        of this iteration's copies raised, or every rank's updated parameters gathered."""
        sharded = state.shard.sharded
        self._ensure_staging(sharded)
        result = sharded.step(hyper, [BufferView(self._params.data_ptr(), _FLOAT32,
                                                 self._params.numel())])
        device = params[0].device if params else torch.device("cpu")
        shard = None
        failure, self._failure = self._failure, None

        def copy_shard():
            nonlocal shard
            if failure is not None:
                raise failure
            if not result.skipped:
                shard = self._copy_shard_to_device(device)

        what = f"param group {self.group_index}: the shard's copies between host and device"
        comm.agreed(what, copy_shard)
        if not result.skipped:
            self._gather(state, params, shard, comm)
        return result

    def _copy_shard_to_device(self, device):
        what = (f"param group {self.group_index}: the host -> device copy of the updated shard "
                "failed")
        consequence = ("zoe took the step on every rank and no rank's device parameters were "
                       "updated: load the latest checkpoint")
        shard = self._buffer("shard", self._params.numel(), device)
        with _device_call(what, consequence):
            event = self.backend.copy_to_device(self._params, shard)
            _wait(self.backend, event, "shard_params")
        return shard

    def _gather(self, state, params, shard, comm):
        """Every rank's updated shard all-gathered on the device, in rounds, into ``params``
        (those handed to zoe with a gradient: not state.shard.absent)."""
        total, world = state.element_count(), comm.world_size
        counts, begins = shard_counts(total, world), shard_boundaries(total, world)
        largest = max(counts)
        piece = max(1, min(self.round_elements, largest))
        round_buffer = self._buffer("gather", piece * world, shard.device)
        offsets = state.offsets()
        for first in range(0, largest, piece):
            round_counts = [max(0, min(piece, count - first)) for count in counts]
            mine = round_counts[comm.rank]
            gathered = comm.gather(shard[first : first + mine], round_counts,
                                   out=round_buffer[: sum(round_counts)])
            at = 0
            for rank, count in enumerate(round_counts):
                self._write_params(state, params, offsets, gathered[at : at + count],
                                   begins[rank] + first)
                at += count

    @staticmethod
    def _write_params(state, params, offsets, values, first):
        """``values``, elements [first, first + len) of the group, into the parameters they
        cover (each in its dtype), except those without a gradient on any rank."""
        end = first + values.numel()
        for index, (param, offset) in enumerate(zip(params, offsets)):
            lo, hi = max(first, offset), min(end, offset + param.numel())
            if hi <= lo or index in state.shard.absent:
                continue
            # .data: the optimizer's own write does not count as a write from outside.
            param.data.view(-1)[lo - offset : hi - offset].copy_(values[lo - first : hi - first])

    def end_iteration(self):
        """After a step, taken or failed: every bucket buffer is free again, and a copy's failure
        not reported by a step that failed first is dropped with its step."""
        self._free.extend(self._in_use.values())
        self._in_use = {}
        self._failure = None

    def close(self):
        """Releases the staging (every copy into or out of it was waited for)."""
        self._buffers = {}
        self._free, self._in_use = [], {}
        if self._staging is not None:
            try:
                self._staging.release()
            except Exception:  # the engine may be closed already
                pass
            self._staging = None
