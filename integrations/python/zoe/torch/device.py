"""Parameters on a device in zoe.torch's optimizers: ZeRO-Offload's data path.

The model lives on a device (a CUDA GPU, or the CPU twin that stands in for one in tests); the
optimizer state lives in zoe (DRAM or NVMe) and steps on the CPU. Per param group:

* backward: as each parameter's gradient becomes final (its AccumulateGrad node has run), the
  gradient is copied device -> host on a side stream into the group's staging memory, a zoe
  tensor homed in HOST (pinned, counted against the HOST budget). Once that copy's event has
  completed the gradient is handed to the zoe group with accumulate_grad, so the group starts
  reading its state while backward goes on. This happens only while the hooks are armed
  (``with optimizer.overlap():`` around the backward that ends the accumulation); otherwise the
  gradients are copied and handed over at step().
* step: the rest of the gradients are handed over (waiting for their copies), zoe steps with the
  accumulated gradients and writes the updated parameters, in their dtype, into staging; each goes
  host -> device on the side stream, and the current stream is made to wait for that copy, so the
  next use of the parameters is ordered after it without blocking the host.

The device logic is written once against ``DeviceBackend``; ``CudaBackend`` implements it with
torch.cuda streams and events, ``HostTwin`` with CPU tensors. ``HostTwin(adversarial=True)``
delays every copy (it completes only after a few polls, or when waited) and fills its destination
with NaN until then, and a copy whose own event was never waited lands again later, so a missing
wait shows up as a wrong result instead of passing by luck. Each wait is named in WAITS."""

import contextlib
import ctypes
import time

import torch

from .. import _capi
from ..engine import BufferView, whole_chunks
from ..errors import Error, FailedPrecondition, Internal, IoError, NoSpace, as_zoe_error
from .common import _DTYPES, _invalid, _pager_of
from .grad_hooks import on_gradient_accumulated

# zoe tensors occupy whole chunks (zoe.chunk_size, 64 MiB by default); staging is rounded to it
# when the optimizer sizes its engine's tensor swap space.
_CHUNK_BYTES = 64 << 20
_ALIGN = 64  # bytes between the starts of two parameters' staging

# Every wait of the device path, by name: the DeviceBackend call it makes and what it orders.
# DeviceGroup and zero_places.DevicePlace wait only through _wait(). tests/test_device_waits.py
# leaves out each in turn and shows that a test fails on the adversarial twin without it; it also
# checks that this table names every wait there is, so a wait cannot be added without such a case.
WAITS = {
    "grad_poll": "ready",  # _hand_over_ready: a gradient reaches zoe once its copy has ended
    "grad_copy": "wait",  # _drain: the same at step()
    "abandon": "wait",  # abandon: copies into the staging end before they are forgotten
    "speculate": "wait",  # _speculate: zoe's updates overwrite the staging the last copies read
    "step": "wait",  # step: the same for zoe's step
    "write_back": "wait_current",  # _copy_params_to_device: the next use of the parameters
    "close": "wait",  # close: no copy uses the staging once it is released
    # ZeRO stages 1 and 2 over ranks (zero_places.DevicePlace)
    "shard_grad": "wait",  # to_host: zoe reads a reduced gradient once its copy has ended
    "shard_params": "wait",  # gather: the all-gather sends the shard once its copy has ended
}
_SKIPPED_WAITS_FOR_TESTING = frozenset()  # names of WAITS to leave out; only the mutation tests


def _wait(backend, event, name):
    """``backend.<WAITS[name]>(event)``: ready()'s answer, else None."""
    if name in _SKIPPED_WAITS_FOR_TESTING:
        return True  # as if the copy had ended
    return getattr(backend, WAITS[name])(event)


class DeviceBackend:
    """What the device path needs from a device: asynchronous copies on a side stream whose
    completion is an event, and ordering the current stream after an event.

    Contract: ``copy_to_host`` and ``copy_to_device`` return at once; a copy reads its source
    after the work already issued on the current stream. Its destination holds the source's
    values once ``ready(event)`` has returned True or ``wait(event)`` returned; after
    ``wait_current(event)`` the current stream's later work (for the twin: the host) sees them.
    Until ready() or wait() of that very event the copy may still read its source and write its
    destination: the source must not be written or released, nor another copy issued into the
    destination, before. Nothing else ends a copy, neither wait_current() nor the end of another
    copy (CudaBackend's one side stream runs its copies in order; the device path does not rely
    on it, and the adversarial twin holds it to that)."""

    name = "device"

    def copy_to_host(self, src, dst):
        raise NotImplementedError

    def copy_to_device(self, src, dst):
        raise NotImplementedError

    def ready(self, event):
        raise NotImplementedError

    def wait(self, event):
        raise NotImplementedError

    def wait_current(self, event):
        raise NotImplementedError


class CudaBackend(DeviceBackend):
    """torch.cuda: one side stream per device, copies with non_blocking=True, CUDA events."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.name = str(self.device)
        self._stream = torch.cuda.Stream(device=self.device)

    def _copy(self, src, dst):
        current = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(current)  # src is final, dst no longer in use, on `current`
        with torch.cuda.stream(self._stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        for tensor in (src, dst):
            if tensor.is_cuda:  # the caching allocator must not reuse it before the copy ran
                tensor.record_stream(self._stream)
        return event

    def copy_to_host(self, src, dst):
        return self._copy(src, dst)

    def copy_to_device(self, src, dst):
        return self._copy(src, dst)

    def ready(self, event):
        return event.query()

    def wait(self, event):
        event.synchronize()

    def wait_current(self, event):
        torch.cuda.current_stream(self.device).wait_event(event)


class _TwinCopy:
    """A copy of the twin. Adversarial, it delivers ``snapshot`` (its source's values when it was
    issued), or NaN when its source was written while it was in flight (torn)."""

    def __init__(self, number, src, dst, polls_left, snapshot=None):
        self.number, self.src, self.dst = number, src, dst
        self.polls_left, self.snapshot = polls_left, snapshot
        self.delivered = self.ended = snapshot is None  # the plain twin's copy is done at once

    def deliver(self):
        """The copy's write reaching its destination (again, when it was delivered already)."""
        if not torch.equal(_bits(self.src), _bits(self.snapshot)):  # torn
            self.dst.fill_(float("nan"))
        elif not self.delivered:
            self.dst.copy_(self.snapshot)
        self.delivered = True

    def end(self):
        self.deliver()
        self.ended = True
        self.src = self.snapshot = None


def _bits(tensor):
    return tensor.reshape(-1).view(torch.uint8)


def _overlap(a, b):
    a_start, b_start = a.data_ptr(), b.data_ptr()
    return (a_start < b_start + b.numel() * b.element_size()
            and b_start < a_start + a.numel() * a.element_size())


class HostTwin(DeviceBackend):
    """The CPU twin of a device: the model's "device" tensors are CPU tensors.

    Without ``adversarial`` copies complete at once. With it the twin does the worst the
    DeviceBackend contract allows, so that a missing wait shows up as a wrong result: a copy
    snapshots its source and fills its destination with NaN; it delivers the snapshot when it
    is waited, after ``late_polls`` calls of ready() returned False, or for the current stream
    (wait_current(); the host is the twin's current stream). Only ready() and wait() of the copy
    itself end it: until then it is in flight, even after wait_current(). A copy in flight whose
    source is written is torn and delivers NaN; a copy never ended lands again (its stale
    snapshot, or NaN when torn) right after a later copy into the same destination delivers, or
    at ``synchronize()``."""

    name = "host twin"

    def __init__(self, adversarial=False, late_polls=2):
        self.adversarial = adversarial
        self.late_polls = late_polls
        self.copies = 0  # submitted copies, for tests
        self._in_flight = []  # adversarial: copies not ended by ready() or wait(), oldest first

    def _copy(self, src, dst):
        self.copies += 1
        if not self.adversarial:
            dst.copy_(src)
            return _TwinCopy(self.copies, None, dst, 0)
        source = src.detach()
        copy = _TwinCopy(self.copies, source, dst, self.late_polls, source.clone())
        dst.fill_(float("nan"))
        self._in_flight.append(copy)
        return copy

    def copy_to_host(self, src, dst):
        return self._copy(src, dst)

    def copy_to_device(self, src, dst):
        return self._copy(src, dst)

    def ready(self, event):
        if event.ended:
            return True
        if event.polls_left > 0:
            event.polls_left -= 1
            return False
        self._end(event)
        return True

    def wait(self, event):
        if not event.ended:
            self._end(event)

    def wait_current(self, event):
        if not event.ended:
            event.deliver()
            self._land_strays(event)

    def synchronize(self):
        """Every copy in flight lands, oldest first (as torch.cuda.synchronize() lets every copy
        finish)."""
        copies, self._in_flight = self._in_flight, []
        for copy in copies:
            copy.end()

    def in_flight(self):
        """The number of copies that ready() or wait() did not end (adversarial twin)."""
        return len(self._in_flight)

    def _end(self, event):
        self._in_flight.remove(event)
        event.end()
        self._land_strays(event)

    def _land_strays(self, event):
        """Copies into ``event``'s destination issued before it and not ended land after it:
        nothing ordered them before it."""
        for copy in [c for c in self._in_flight if c.number < event.number]:
            if _overlap(copy.dst, event.dst):
                self._in_flight.remove(copy)
                copy.end()


def _device_error(error, what, consequence):
    """A DeviceBackend's exception as zoe's: "<what> (<the error>); <consequence>". A zoe.Error
    keeps its class, an OSError takes the class of its errno, anything else (torch's
    RuntimeError for a CUDA error) is IoError, as zoe's device tier reports a failed CUDA
    copy."""
    cause = str(error) if isinstance(error, Error) else f"{type(error).__name__}: {error}"
    message = f"{what} ({cause}); {consequence}"
    if isinstance(error, (Error, OSError)):
        return as_zoe_error(error, message)
    return IoError(_capi.Status.IO, message)


@contextlib.contextmanager
def _device_call(what, consequence):
    """What the DeviceBackend raises in the block, raised as zoe's (_device_error);
    ``consequence`` may be a function, called when it fails."""
    try:
        yield
    except Exception as error:
        consequence = consequence() if callable(consequence) else consequence
        raise _device_error(error, what, consequence) from error


def backend_for(group_index, params, device_backend):
    """The DeviceBackend of a param group, or None for a group of CPU parameters stepped in place
    (the CPU path). All parameters of a group must be on one device."""
    devices = {param.device for param in params}
    if len(devices) > 1:
        listed = ", ".join(sorted(str(device) for device in devices))
        raise _invalid(
            f"param group {group_index} has parameters on {listed}; a param group's parameters "
            "must be on one device (put each device's parameters in a param group of their own)"
        )
    device = next(iter(devices), torch.device("cpu"))
    if any(_pager_of(param) for param in params):
        # stepped through the pager, their gradients streamed to the host (grad_stream.py)
        return None
    if device.type == "cuda":
        if device_backend is not None and not isinstance(device_backend, CudaBackend):
            raise _invalid(
                f"param group {group_index} is on {device}; device_backend="
                f"{device_backend.name!r} is for parameters on the CPU (the CPU twin)"
            )
        return CudaBackend(device)
    if device.type != "cpu":
        raise _invalid(
            f"param group {group_index} is on {device}; zoe optimizers take CPU or CUDA tensors"
        )
    return device_backend


def staging_bytes(params, accumulation):
    """Bytes of HOST staging a group of device parameters needs: gradients (in the dtype
    ``accumulation``, grad_accumulation.py, gives them) and parameters."""
    total = 0
    for param in params:
        grad_bytes = param.numel() * _element_size(accumulation.dtype_of(param))
        total += _aligned(grad_bytes) + _aligned(param.numel() * param.element_size())
    return total


def _element_size(dtype):
    return torch.empty(0, dtype=dtype).element_size()


def swap_bytes_for(param_groups, group_staging_bytes):
    """Tensor swap space an engine needs to hold the staging of these groups (each group's
    staging, ``group_staging_bytes(params)``, is one zoe tensor, a whole number of chunks)."""
    total = 0
    for params in param_groups:
        nbytes = group_staging_bytes(params)
        total += whole_chunks(nbytes, _CHUNK_BYTES)
    return total


def _aligned(nbytes):
    return -(-nbytes // _ALIGN) * _ALIGN


def host_staging(engine, name, nbytes, group_index):
    """A param group's staging: a zoe tensor of ``nbytes`` homed in HOST (pinned DRAM, counted
    against the HOST budget), acquired for the optimizer's life, and a uint8 CPU tensor over it.
    Its chunks are its own (a chunk group of its name): no other tensor shares them.
    NoSpace names the settings that make room for it."""
    try:
        tensor = engine.register_tensor(name, nbytes, _capi.DType.UINT8, _capi.Tier.HOST,
                                        group=name)
    except NoSpace as error:
        raise NoSpace(
            error.status,
            f"{error}; the staging of param group {group_index} ({nbytes} bytes of pinned DRAM "
            "for device parameters) is a zoe tensor homed in HOST: give the engine "
            "zoe.tensor_swap_bytes and zoe.tensor_host_budget for it",
        ) from error
    address = tensor.acquire(_capi.Tier.HOST, _capi.Access.READ_WRITE)
    buffer = (ctypes.c_char * nbytes).from_address(address)
    return tensor, torch.frombuffer(buffer, dtype=torch.uint8)


class DeviceGroup:
    """The device path of one param group: staging, hooks, hand-over and write-back."""

    def __init__(self, optimizer, group_index, backend):
        self.optimizer = optimizer
        self.group_index = group_index
        self.backend = backend
        self.params = list(optimizer.param_groups[group_index]["params"])
        self.offsets = []
        offset = 0
        for param in self.params:
            self.offsets.append(offset)
            offset += param.numel()
        self._staging = None  # the zoe tensor; acquired on HOST for the optimizer's life
        self._grad_host = []  # per parameter: CPU tensor over its gradient staging
        self._param_host = []  # per parameter: CPU tensor over its updated-parameter staging
        self._pending = []  # [(parameter index, event)] gradient copies not handed over yet
        self._handed = set()  # parameter indices handed over for the coming step
        self._absent = set()  # indices handed over as "no gradient" for the coming step
        self._to_device = []  # events of the latest host -> device copies
        self.armed = False
        self._hooks = []
        self.stats = {"handed_in_backward": 0, "handed_at_step": 0, "step_seconds": 0.0}
        for index, param in enumerate(self.params):
            if param.requires_grad:
                self._hooks.append(on_gradient_accumulated(param, self._hook_for(index)))

    def _state(self):
        """The optimizer's GroupState of this param group."""
        return self.optimizer._groups[self.group_index]

    # --- staging ---------------------------------------------------------------------------

    def _ensure_staging(self):
        if self._staging is not None:
            return
        name = f"{self.optimizer._group_name(self.group_index)}.staging"
        accumulation = self.optimizer.accumulation
        self._staging, raw = host_staging(self.optimizer.engine, name,
                                          staging_bytes(self.params, accumulation),
                                          self.group_index)
        cursor = 0
        for region, dtype_of in ((self._grad_host, accumulation.dtype_of),
                                 (self._param_host, lambda param: param.dtype)):
            for param in self.params:
                dtype = dtype_of(param)
                n = param.numel() * _element_size(dtype)
                region.append(raw[cursor : cursor + n].view(dtype))
                cursor += _aligned(n)

    def close(self):
        """Removes the hooks and releases the staging (idempotent)."""
        for handle, _ in self._hooks:
            handle.remove()
        self._hooks = []
        for event in [event for _, event in self._pending] + self._to_device:
            _wait(self.backend, event, "close")
        self._pending = []
        self._to_device = []
        if self._staging is not None:
            with contextlib.suppress(Exception):  # the engine may be closed already
                self._staging.release()
            self._staging = None

    # --- backward --------------------------------------------------------------------------

    def _hook_for(self, index):
        def hook():
            if not self.armed:
                return
            try:
                self._copy_grad(index)
                self._hand_over_ready()
            except BaseException:
                self.abandon()
                raise
        return hook

    def _grad_copy(self, index):
        """A _device_call() around the copy of parameter ``index``'s gradient (a failure is
        followed by abandon(), which leaves everything as it was)."""
        what = (f"param group {self.group_index}: the device -> host copy of the gradient of "
                f"parameter {index} failed")

        def consequence():
            retry = ("backward was interrupted: zero the gradients and run it again"
                     if self.armed else "step() copies the gradients again")
            return ("the step was not taken, the parameters and the optimizer state are "
                    f"unchanged; {retry}")

        return _device_call(what, consequence)

    def _forget_copies_in_flight(self):
        """Waits for the gradient copies not handed over yet (a failed one too) and forgets
        them: their staging may be written again."""
        for _, event in self._pending:
            with contextlib.suppress(Exception):
                _wait(self.backend, event, "abandon")
        self._pending = []

    def abandon(self):
        """Drops the step being gathered: copies in flight are waited for and forgotten, and the
        gradients already handed to zoe are consumed by a step zoe skips (one gradient handed as
        NaN, the others as "no gradient"), which changes nothing. param.grad stays as it is, so
        step() can start the gathering again."""
        self._forget_copies_in_flight()
        if not self._handed:
            if self._absent:  # only "no gradient" was handed over: nothing to consume
                self._state().zoe_group.discard_grads()
                self._absent = set()
            return
        missing = [index for index in range(len(self.params))
                   if index not in self._handed and index not in self._absent]
        self._handed, self._absent = set(), set()
        if not missing:  # zoe holds every gradient: a step() would consume them
            raise FailedPrecondition(
                _capi.Status.FAILED_PRECONDITION,
                f"param group {self.group_index}: every gradient was handed to zoe before the "
                "failure; call step() to take the step",
            )
        zoe_group = self._state().zoe_group
        poison = self._grad_host[missing[0]]
        poison.fill_(float("nan"))
        zoe_group.accumulate_grad(self.offsets[missing[0]], _staged_view(poison))
        for index in missing[1:]:
            param = self.params[index]
            zoe_group.accumulate_grad(
                self.offsets[index], BufferView(0, _DTYPES[param.dtype], param.numel())
            )
        result = zoe_group.step(None, grads=[], params_out=[])
        if not result.skipped:
            raise Internal(_capi.Status.INTERNAL, "an abandoned step was not skipped by zoe")

    def _copy_grad(self, index):
        """Starts the device -> host copy of a parameter's gradient (final now)."""
        grad = self.optimizer.accumulation.gradient(self.params[index])
        if grad is None or index in self._handed:
            return
        self._check_grad(index, grad)
        self._ensure_staging()
        self._begin_step()
        # Earlier copies into this staging were handed over and stepped: the slot is free.
        with self._grad_copy(index):
            event = self.backend.copy_to_host(grad.detach().reshape(-1), self._grad_host[index])
        self._pending = [(i, e) for i, e in self._pending if i != index]
        self._pending.append((index, event))

    def _check_grad(self, index, grad):
        param = self.params[index]
        where = f"gradient of parameter {index} of param group {self.group_index}"
        if grad.is_sparse:
            raise _invalid(f"{where}: sparse gradient")
        expected = self.optimizer.accumulation.dtype_of(param)
        if grad.dtype != expected or grad.device != param.device:
            raise _invalid(
                f"{where} is {grad.dtype} on {grad.device}; expected {expected} on "
                f"{param.device}, the parameter's device"
            )

    def _begin_step(self):
        """Before the first hand-over of a step: the zoe group exists and holds the parameters'
        latest values (written outside the optimizer, e.g. by load_state_dict)."""
        if self._handed or self._pending or self._absent:
            return
        self.optimizer._zoe_group(self._state())
        self.optimizer._sync_external_writes(self._state())
        if self.armed and self.optimizer._speculative_group(self._state()):
            self._speculate()

    def _speculate(self):
        """Lets zoe update each chunk as soon as its gradients are handed over, during backward
        (zoe commits, recomputes or discards at step(); see OptimizerGroup.speculate). The
        updates write the parameters' staging, so the previous step's host -> device copies out
        of it must be complete first."""
        for event in self._to_device:
            _wait(self.backend, event, "speculate")
        self._to_device = []
        zoe_group = self._state().zoe_group
        zoe_group.speculate(
            self.optimizer._step_hyper(self._state()),
            params_out=[_staged_view(values) for values in self._param_host],
            loss_scale=self.optimizer.grad_scale,
        )

    def _hand_over_ready(self):
        still = []
        for index, event in self._pending:
            with self._grad_copy(index):
                ended = _wait(self.backend, event, "grad_poll")
            if ended:
                self._hand_over(index)
                self.stats["handed_in_backward"] += 1
            else:
                still.append((index, event))
        self._pending = still

    def _hand_over(self, index):
        """Gives the group a gradient whose copy has completed."""
        zoe_group = self._state().zoe_group
        zoe_group.accumulate_grad(self.offsets[index], _staged_view(self._grad_host[index]))
        self._handed.add(index)

    def _drain(self):
        """Hands over every gradient not handed over yet; a parameter without one is handed as
        "no gradient" (its state and step count stay as they are)."""
        self._begin_step()
        for index in range(len(self.params)):
            if index not in self._handed and not any(i == index for i, _ in self._pending):
                self._copy_grad(index)
        for index, event in self._pending:
            with self._grad_copy(index):
                _wait(self.backend, event, "grad_copy")
            self._hand_over(index)
            self.stats["handed_at_step"] += 1
        self._pending = []
        zoe_group = self._state().zoe_group
        for index, param in enumerate(self.params):
            if index not in self._handed and index not in self._absent:
                count = param.numel()
                zoe_group.accumulate_grad(
                    self.offsets[index], BufferView(0, _DTYPES[param.dtype], count)
                )
                self._absent.add(index)

    # --- the step --------------------------------------------------------------------------

    def has_grads(self):
        accumulation = self.optimizer.accumulation
        return bool(self._handed or self._pending) or any(
            accumulation.present(param) for param in self.params
        )

    def _hand_over_all(self):
        """_drain(), the gathering abandoned when it fails (everything as it was)."""
        try:
            self._drain()
        except BaseException:
            self.abandon()
            raise

    def grad_sum_squares(self):
        """The sum of squares of the group's gradients as zoe scanned them (every gradient
        handed over now; 0.0 without any): for clipping several groups by their global norm."""
        if not self.has_grads():
            return 0.0
        self._hand_over_all()
        return self._state().zoe_group.grad_sum_squares()

    def discard(self):
        """Drops the coming step: copies in flight are waited for and forgotten, and zoe discards
        the gradients handed over (the state is as it was; param.grad stays, so a step()
        gathers them anew). For a step the optimizer skips as a whole, or one that failed in
        another param group."""
        self._forget_copies_in_flight()
        if self._handed or self._absent:
            self._state().zoe_group.discard_grads()
        self._handed, self._absent = set(), set()

    def step(self, hyper, loss_scale=1.0):
        """Steps the group with the gradients handed over (the rest handed now), their loss
        scaled by ``loss_scale``, and starts the host -> device copies of the updated
        parameters. Returns the zoe StepResult."""
        started = time.perf_counter()
        self._hand_over_all()
        present = [index in self._handed for index in range(len(self.params))]
        for event in self._to_device:  # staging of the previous step's parameters is free
            _wait(self.backend, event, "step")
        self._to_device = []
        zoe_group = self._state().zoe_group
        views = [_staged_view(values) for values in self._param_host]
        # A zoe step that fails keeps the gradients handed to it: step() again retries it.
        result = zoe_group.step(hyper, grads=[], params_out=views, loss_scale=loss_scale)
        self._handed, self._absent = set(), set()
        if not result.skipped:
            self._copy_params_to_device(present)
        self.stats["step_seconds"] += time.perf_counter() - started
        return result

    def _copy_params_to_device(self, present):
        for index, param in enumerate(self.params):
            if not present[index]:
                continue
            # .data: the optimizer's own write does not count as a write from outside.
            target = param.data.view(-1)
            what = (f"param group {self.group_index}: the host -> device copy of parameter "
                    f"{index} failed")
            consequence = (f"zoe took the step, and the device's parameters from {index} on "
                           "may still hold their values before it")
            with _device_call(what, consequence):
                event = self.backend.copy_to_device(self._param_host[index], target)
                _wait(self.backend, event, "write_back")
            self._to_device.append(event)


def _staged_view(values):
    return BufferView(values.data_ptr(), _DTYPES[values.dtype], values.numel())


@contextlib.contextmanager
def overlap(device_groups):
    """Arms the gradient hooks of every device group for the block."""
    armed = [group for group in device_groups if group is not None]
    for group in armed:
        group.armed = True
    try:
        yield
    finally:
        for group in armed:
            group.armed = False


def listed_params(params, device_backend, group_staging_bytes):
    """``params`` (an iterable of tensors or of param-group dicts) read once into lists, and the
    tensor swap bytes the staging of its device groups needs (0 when every group is stepped on
    the CPU in place), ``group_staging_bytes(params)`` for each. A tensor is returned as it is,
    for torch to refuse."""
    if isinstance(params, torch.Tensor):
        return params, 0
    params = list(params)
    if params and isinstance(params[0], dict):
        for group in params:
            inner = group["params"]
            group["params"] = [inner] if isinstance(inner, torch.Tensor) else list(inner)
        groups = [group["params"] for group in params]
    else:
        groups = [params]
    on_device = [
        group for group in groups
        if device_backend is not None or any(param.device.type != "cpu" for param in group)
    ]
    return params, swap_bytes_for(on_device, group_staging_bytes)


class _CudaMemory:
    """Device memory zoe owns, described by __cuda_array_interface__ for torch.as_tensor."""

    def __init__(self, address, nbytes):
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (address, False),
            "strides": None,
            "version": 3,
        }


def wrap_tier_memory(address, nbytes, dtype, device):
    """A flat tensor of ``dtype`` over zoe memory at ``address``: on ``device`` when it is a CUDA
    device (zoe's DEVICE tier on a GPU), else a CPU tensor (HOST, or DEVICE on the stand-in).
    Borrowed: valid while zoe keeps the memory acquired."""
    if device.type == "cuda":
        raw = torch.as_tensor(_CudaMemory(address, nbytes), device=device)
    else:
        raw = torch.frombuffer((ctypes.c_char * nbytes).from_address(address), dtype=torch.uint8)
    return raw.view(dtype)


def check_paging_tier(engine, tier, device):
    """InvalidArgument unless parameters on ``device`` can be paged into ``tier``: HOST takes a
    CPU model; DEVICE takes a CUDA model when the engine's device tier is a GPU, and a CPU model
    (the CPU twin) when it is the host stand-in."""
    if tier == _capi.Tier.HOST:
        if device.type != "cpu":
            raise _invalid(
                f"parameters on {device} cannot be paged into the HOST tier (they would become "
                "CPU tensors); page them into tier=zoe.Tier.DEVICE"
            )
        return
    if tier != _capi.Tier.DEVICE:
        raise _invalid(f"tier = {tier!r} is not allowed; allowed: zoe.Tier.HOST, zoe.Tier.DEVICE")
    device_info = engine.stats().get("device", {})
    if not device_info.get("present", False):
        raise _invalid("tier=DEVICE needs an engine with a device tier (zoe.device)")
    gpu = bool(device_info.get("gpu", False))
    if gpu and device.type != "cuda":
        raise _invalid(
            f"the engine's device tier is {device_info.get('backend')!r} (a GPU) and the model "
            f"is on {device}; move the model to the GPU first"
        )
    if not gpu and device.type != "cpu":
        raise _invalid(
            f"the model is on {device} and the engine's device tier is "
            f"{device_info.get('backend')!r} (the host stand-in); create the engine with "
            '"zoe": {"device": "cuda"}'
        )
