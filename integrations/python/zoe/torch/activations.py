"""zoe.torch.offload_activations: the tensors autograd saves for backward, moved out of the memory
that trains while forward runs and brought back, ahead of need, while backward runs.

``with offload_activations(engine, device="nvme", min_bytes=1 << 20) as offload: loss = model(x)``
installs saved-tensor hooks for the block. Every saved tensor of at least ``min_bytes`` that is
not a parameter (nor a view of one) is copied into pinned DRAM that the engine's tensors provide
(counted against zoe.tensor_host_budget): for a model on a GPU on a side stream
(``CudaBackend``), for the CPU twin through ``device_backend=HostTwin(...)``, for a model on the
CPU by a plain copy. With ``device="nvme"`` the full buckets are written to NVMe by a background
thread through the engine (io_uring, checksums) and only ``pinned_bytes`` of them are held at
once; with ``device="cpu"`` (a model on a device) they stay in pinned DRAM. Backward reads them
back in the reverse order of forward, prefetching ``prefetch_bytes`` ahead. The tensors are
restored with their dtype, shape and strides, so gradients are the same bits.

Composition with offload_parameters: a saved tensor that is a paged parameter is left to its
pager (the pager's packer runs first); inside a paged model the hooks are re-installed around
every module call, so they are the innermost and see the model's saved tensors.

Lifetime: a bucket is freed (its slot back to the engine's pool, activation_store.py) when no
saved tensor refers to it any more: after the backward that used it, when the graph is dropped,
or at once when the forward raised. ``backward(retain_graph=True)`` keeps the saved tensors, so a
second backward reads them again. Statistics: ``offload.stats()``.
"""

import collections
import time
import weakref

import torch

from .. import _capi
from ..errors import Error, FailedPrecondition, OutOfMemory, as_zoe_error
from .activation_store import Bucket, aligned, pool_for
from .common import _invalid
from .device import CudaBackend

_DEVICES = ("auto", "cpu", "nvme")
_HISTORY = 1000  # iterations whose statistics are kept
_MiB = 1 << 20


class _Saved:
    """A saved tensor moved into a bucket: what the pack hook returns and unpack takes."""

    __slots__ = ("owner", "forward", "bucket", "offset", "nbytes", "dtype", "size", "stride",
                 "device", "backend", "__weakref__")

    def __del__(self):
        owner = self.owner
        if owner is not None:
            self.owner = None
            owner._drop(self)


class _PagerSaved:
    """A paged parameter packed by its pager."""

    __slots__ = ("pager", "packed")

    def __init__(self, pager, packed):
        self.pager, self.packed = pager, packed


class _Forward:
    """The buckets and figures of one forward (one ``with`` block) and its backward."""

    def __init__(self, number):
        self.number = number
        self.buckets = []
        self.open = None  # the bucket being filled
        self.closed_queue = []  # closed buckets whose write is not submitted yet (nvme)
        self.finished = self.raised = False
        self.prefetch_budget_used = 0
        self.stats = {"tensors": 0, "bytes_to_host": 0, "bytes_to_nvme": 0,
                      "bytes_from_nvme": 0, "kept_tensors": 0, "kept_bytes": 0, "buckets": 0,
                      "prefetch_hits": 0, "prefetch_misses": 0, "resident_hits": 0,
                      "stall_seconds": 0.0, "peak_pinned_bytes": 0}


def _dense_stride(tensor):
    """The tensor's strides when its elements fill a block with no gaps or overlaps (any order
    of dimensions), else the contiguous strides; the layout its copy is given."""
    dims = sorted((s, n) for s, n in zip(tensor.stride(), tensor.size()) if n != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return _contiguous_stride(tensor.size())
        expected *= size
    return tuple(tensor.stride())


def _contiguous_stride(size):
    stride, running = [], 1
    for n in reversed(size):
        stride.append(running)
        running *= max(n, 1)
    return tuple(reversed(stride))


def _is_parameter(tensor):
    """A leaf that requires grad (a parameter), or a view of one: memory that lives anyway."""
    base = tensor._base if tensor._base is not None else tensor
    return (base.is_leaf and base.requires_grad) or hasattr(base, "_zoe_pager")


def _pager_in(module, cache):
    """The pager that pages ``module``'s parameters (offload_parameters), or None."""
    key = id(module)
    if key not in cache:
        cache[key] = next((p._zoe_pager for p in module.parameters()
                           if getattr(p, "_zoe_pager", None) is not None), None)
    return cache[key]


class ActivationOffload:
    """What ``offload_activations`` returns: a reusable context manager around one forward (each
    ``with`` is one iteration), and the statistics of the iterations so far."""

    def __init__(self, engine, device="auto", min_bytes=_MiB, device_backend=None,
                 bucket_bytes=None, pinned_bytes=None, prefetch_bytes=None):
        if device not in _DEVICES:
            raise _invalid(f"device = {device!r} is not allowed; allowed: "
                           f"{', '.join(map(repr, _DEVICES))}")
        if int(min_bytes) < 1:
            raise _invalid(f"min_bytes = {min_bytes!r} must be at least 1")
        self.engine = engine
        self.device = device
        self.min_bytes = int(min_bytes)
        self.device_backend = device_backend
        self.pool = pool_for(engine)
        chunk = self.pool.chunk_bytes
        self.bucket_bytes = aligned(bucket_bytes or max(chunk, 4 * _MiB), chunk)
        self.pinned_bytes = None if pinned_bytes is None else int(pinned_bytes)
        self.prefetch_bytes = int(self.bucket_bytes * 2 if prefetch_bytes is None
                                  else prefetch_bytes)
        # Defaults follow the largest bucket seen (see _pinned_budget); given sizes are kept.
        self._sizes_given = {"pinned": pinned_bytes is not None,
                             "prefetch": prefetch_bytes is not None}
        self._largest_bucket = 0
        if device != "auto":
            self._set_pinned_bytes()
        # per forward, the latest _HISTORY: its statistics (see stats())
        self.iterations = collections.deque(maxlen=_HISTORY)
        self.forwards_run = 0
        self.last_error = None  # the latest zoe.Error raised by a hook (see _pack)
        self._block_error = None  # one raised by a pack hook of the current block
        self._forward = None
        self._forwards = []  # forwards that may still hold buckets
        self._active = False
        self._hook_stack = []  # saved_tensors_hooks entered, innermost last
        self._global_hooks = []
        self._module_pushes = []
        self._pagers = []
        self._pager_cache = {}
        self._backends = {}
        self._dedup = {}

    def _set_pinned_bytes(self):
        """pinned_bytes once the device is known: by default four buckets for "nvme", the
        engine's tensor HOST budget for "cpu"."""
        if self.pinned_bytes is None:
            self.pinned_bytes = (4 * self.bucket_bytes if self.device == "nvme"
                                 else int(self.engine.stats()["host_budget"]["tensors"]))
        if self.device == "nvme" and self.pinned_bytes < 2 * self.bucket_bytes:
            raise _invalid(f"pinned_bytes = {self.pinned_bytes} must hold two buckets "
                           f"({2 * self.bucket_bytes} bytes: bucket_bytes = "
                           f"{self.bucket_bytes}): one filling while one is written")

    # --- the block -------------------------------------------------------------------------

    def __enter__(self):
        if self._active:
            raise FailedPrecondition(_capi.Status.FAILED_PRECONDITION,
                                     "offload_activations is already active; blocks of one "
                                     "ActivationOffload do not nest")
        self._check_device_choice()
        self._forward = _Forward(self.forwards_run)
        self.forwards_run += 1
        self._pager_cache.clear()  # module ids may have been reused since the last block
        self._block_error = None
        self.iterations.append(self._forward.stats)
        self._live_forwards()
        self._forwards.append(self._forward)
        self._active = True
        self._push_hooks()
        module = torch.nn.modules.module
        self._global_hooks = [module.register_module_forward_pre_hook(self._module_pre),
                              module.register_module_forward_hook(self._module_post)]
        return self

    def __exit__(self, kind, error, traceback):
        for handle in self._global_hooks:
            handle.remove()
        self._global_hooks = []
        while self._hook_stack:
            self._hook_stack.pop().__exit__(None, None, None)
        self._module_pushes = []
        self._active = False
        forward, self._forward = self._forward, None
        self._dedup.clear()
        if kind is None:
            self._finish(forward)
            return False
        self._abandon(forward)
        block_error, self._block_error = self._block_error, None
        if block_error is not None and error is not block_error:
            raise block_error from error
        return False

    def _check_device_choice(self):
        if self.device == "cpu" and self.device_backend is None and not torch.cuda.is_available():
            raise _invalid(
                "device='cpu' moves activations from a GPU to pinned DRAM; a model on the CPU "
                "keeps them in DRAM already: use device='nvme' (or device_backend=HostTwin() "
                "for the CPU twin of a device)")

    def _push_hooks(self):
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        hooks.__enter__()
        self._hook_stack.append(hooks)

    # Inside a paged model the pager's hooks are entered by its root module's pre-hook, after
    # ours: these global module hooks enter ours again around every module call of the model,
    # so ours are the innermost there and hand paged parameters to the pager themselves.
    def _module_pre(self, module, inputs):
        pager = _pager_in(module, self._pager_cache)
        pushed = pager is not None and self._active
        if pushed:
            if pager not in self._pagers:
                self._pagers.append(pager)
            self._push_hooks()
        self._module_pushes.append(pushed)

    def _module_post(self, module, inputs, output):
        if self._module_pushes and self._module_pushes.pop() and len(self._hook_stack) > 1:
            self._hook_stack.pop().__exit__(None, None, None)

    # --- pack ------------------------------------------------------------------------------

    # torch 1.x raises an exception of a saved-tensor hook as a RuntimeError whose message
    # starts with the class name; the zoe.Error itself is kept in last_error, and one raised in
    # forward leaves the ``with`` block as itself.
    def _pack(self, tensor):
        try:
            return self._pack_one(tensor)
        except Error as error:
            self.last_error = self._block_error = _untraced(error)
            raise

    def _unpack(self, saved):
        try:
            return self._unpack_one(saved)
        except Error as error:
            self.last_error = _untraced(error)
            raise

    def _pack_one(self, tensor):
        if not self._active:
            return tensor  # a stale entry of the hook stack after a forward that raised
        for pager in self._pagers:
            packed = pager._pack(tensor)
            if packed is not tensor:
                return _PagerSaved(pager, packed)
        nbytes = tensor.numel() * tensor.element_size()
        if not self._eligible(tensor):
            return tensor
        if nbytes < self.min_bytes:
            self._forward.stats["kept_tensors"] += 1
            self._forward.stats["kept_bytes"] += nbytes
            return tensor
        self._raise_write_errors(self._forward)
        return self._deduplicated(tensor) or self._move_out(tensor, nbytes)

    @staticmethod
    def _eligible(tensor):
        return (tensor.layout == torch.strided and not tensor.is_quantized
                and tensor.device.type in ("cpu", "cuda") and tensor.numel() > 0
                and not _is_parameter(tensor))

    def _key(self, tensor):
        return (tensor.data_ptr(), tensor.dtype, tensor.device, tuple(tensor.size()),
                tuple(tensor.stride()), tensor._version)

    def _deduplicated(self, tensor):
        """The _Saved of this very tensor when it was saved before in this forward."""
        entry = self._dedup.get(self._key(tensor))
        if entry is None:
            return None
        tensor_ref, saved_ref = entry
        saved = saved_ref()
        return saved if tensor_ref() is tensor and saved is not None else None

    def _backend_for(self, tensor):
        """The DeviceBackend that copies ``tensor``, or None for a CPU model."""
        if tensor.device.type == "cuda":
            backend = self._backends.get(tensor.device)
            if backend is None:
                backend = self._backends[tensor.device] = CudaBackend(tensor.device)
            return backend
        return self.device_backend

    def _move_out(self, tensor, nbytes):
        backend = self._backend_for(tensor)
        self._resolve_device(backend)
        forward = self._forward
        bucket, offset = self._place(forward, nbytes)
        stride = _dense_stride(tensor)
        dst = bucket.view(offset, nbytes).view(tensor.dtype).as_strided(tensor.size(), stride)
        source = tensor.detach()
        if backend is None:
            dst.copy_(source)
        else:
            bucket.copies_in.append(backend.copy_to_host(source, dst))
        saved = _Saved()
        saved.owner, saved.forward, saved.bucket, saved.offset = self, forward, bucket, offset
        saved.nbytes, saved.dtype, saved.size, saved.stride = nbytes, tensor.dtype, \
            tuple(tensor.size()), stride
        saved.device, saved.backend = tensor.device, backend
        bucket.live += 1
        bucket.backend = backend
        forward.stats["tensors"] += 1
        forward.stats["bytes_to_host"] += nbytes
        self._dedup[self._key(tensor)] = (weakref.ref(tensor), weakref.ref(saved))
        if bucket.slot.nbytes > self.bucket_bytes:  # a tensor's own slot: full at once
            self._close(forward, bucket)
        return saved

    def _resolve_device(self, backend):
        if self.device == "auto":
            self.device = "cpu" if backend is not None else "nvme"
            self._set_pinned_bytes()
        if self.device == "cpu" and backend is None:
            raise _invalid(
                "offload_activations(device='cpu') got a saved tensor of a model on the CPU; "
                "its activations are in DRAM already: use device='nvme' (or give "
                "device_backend=HostTwin() for the CPU twin of a device)")

    # --- buckets ---------------------------------------------------------------------------

    def _place(self, forward, nbytes):
        """A bucket with room for ``nbytes`` and the offset they go at."""
        if nbytes > self.bucket_bytes:
            bucket = self._new_bucket(forward, nbytes)
            return bucket, bucket.place(nbytes)
        offset = forward.open.place(nbytes) if forward.open is not None else None
        if offset is not None:
            return forward.open, offset
        if forward.open is not None:
            self._close(forward, forward.open)
        forward.open = self._new_bucket(forward, self.bucket_bytes)
        return forward.open, forward.open.place(nbytes)

    def _pinned_budget(self):
        """The pinned DRAM forward's buckets may hold: pinned_bytes, and by default with
        "nvme" at least the largest bucket seen and two more (a tensor larger than a bucket goes
        alone in a bucket its size; with less room forward would wait for each one's write)."""
        if self._sizes_given["pinned"] or self.device != "nvme":
            return self.pinned_bytes
        return max(self.pinned_bytes, self._largest_bucket + 2 * self.bucket_bytes)

    def _prefetch_budget(self):
        """How far backward reads ahead: prefetch_bytes, and by default at least the largest
        bucket seen and one more, so a large one is read while the one before is used."""
        if self._sizes_given["prefetch"]:
            return self.prefetch_bytes
        return max(self.prefetch_bytes, self._largest_bucket + self.bucket_bytes)

    def _new_bucket(self, forward, nbytes):
        """A bucket of ``nbytes`` (rounded up to chunks) for ``forward``, within the pinned
        budget."""
        needed = aligned(nbytes, self.pool.chunk_bytes)
        self._largest_bucket = max(self._largest_bucket, needed)
        # With "nvme" a tensor larger than the budget still goes, alone.
        while self._pinned(forward) + needed > self._pinned_budget() and (
                self.device != "nvme" or self._pinned(forward) > 0):
            if not self._make_room(forward):
                raise OutOfMemory(
                    _capi.Status.OUT_OF_MEMORY,
                    f"saved activations need {self._pinned(forward) + needed} bytes of pinned "
                    f"DRAM with device={self.device!r}; pinned_bytes is {self.pinned_bytes} (the "
                    "engine's zoe.tensor_host_budget by default): use device='nvme', a larger "
                    "zoe.tensor_host_budget, or a larger min_bytes")
        slot = self.pool.take(needed)
        bucket = Bucket(self, len(forward.buckets), slot)
        forward.buckets.append(bucket)
        forward.stats["buckets"] += 1
        pinned = self._pinned(forward)
        forward.stats["peak_pinned_bytes"] = max(forward.stats["peak_pinned_bytes"], pinned)
        return bucket

    def _pinned(self, forward):
        """Bytes of pinned DRAM this forward's buckets hold (writes in flight included)."""
        return sum(bucket.slot.nbytes for bucket in forward.buckets if _unreleased(bucket)
                   and (bucket.held or _pending(bucket.write_future)))

    def _make_room(self, forward):
        """With device 'nvme': submits the closed buckets' writes and waits for the oldest one
        in flight; False when nothing can be written out."""
        if self.device != "nvme":
            return False
        self._submit_writes(forward, block=True)
        writing = [b for b in forward.buckets if _pending(b.write_future)]
        if not writing and forward.open is not None:
            self._close(forward, forward.open)  # written early, to make room for a large one
            self._submit_writes(forward, block=True)
            writing = [b for b in forward.buckets if _pending(b.write_future)]
        if not writing:
            return False
        writing[0].write_future.exception()  # waits; an error is raised below
        self._raise_write_errors(forward)
        return True

    def _close(self, forward, bucket):
        bucket.closed = True
        if forward.open is bucket:
            forward.open = None
        if self.device == "nvme":
            forward.closed_queue.append(bucket)
            self._submit_writes(forward, block=False)

    def _submit_writes(self, forward, block):
        """Hands closed buckets to the writer thread, oldest first, once their device copies
        have ended (waited for when ``block``, else polled)."""
        while forward.closed_queue:
            bucket = forward.closed_queue[0]
            if not self._copies_ended(bucket, block):
                return
            forward.closed_queue.pop(0)
            if bucket.freed or bucket.live == 0:
                continue
            bucket.write_address = None  # released by write_back on the writer thread
            bucket.write_future = self.pool.background(bucket.write_back)
            forward.stats["bytes_to_nvme"] += bucket.slot.nbytes

    @staticmethod
    def _copies_ended(bucket, block):
        backend = bucket.backend
        if backend is None:
            bucket.copies_in.clear()
            return True
        if block:
            bucket.end_copies(backend, bucket.copies_in)
            return True
        while bucket.copies_in and backend.ready(bucket.copies_in[0]):
            bucket.copies_in.pop(0)
        return not bucket.copies_in

    def _raise_write_errors(self, forward):
        for bucket in forward.buckets:
            future = bucket.write_future
            if future is not None and future.done() and future.exception() is not None:
                error = future.exception()
                raise as_zoe_error(error, f"writing saved activations (bucket {bucket.index} of "
                                   f"forward {forward.number}) to NVMe failed: {error}") from error

    def _finish(self, forward):
        """The end of a forward that returned: the open bucket closes and stays in DRAM (backward
        needs it first); the others' writes are submitted."""
        if forward.open is not None:
            bucket, forward.open = forward.open, None
            bucket.closed = True
        self._submit_writes(forward, block=True)
        forward.finished = True
        for bucket in forward.buckets:
            if bucket.live == 0 and not bucket.freed:
                self._free(bucket)

    def _abandon(self, forward):
        """The end of a forward that raised: every bucket is freed now."""
        forward.raised = forward.finished = True
        forward.open = None
        forward.closed_queue.clear()
        for bucket in forward.buckets:
            if not bucket.freed:
                self._free(bucket)

    def _free(self, bucket):
        """Gives the bucket's slot back: its copies ended, its memory released, on NVMe mode
        evicted (a clean run costs no I/O) after any write in flight (the writer runs in
        order)."""
        bucket.freed = True
        backend = bucket.backend
        if backend is not None:
            bucket.end_copies(backend, bucket.copies_in)
            bucket.end_copies(backend, bucket.copies_out)
        if bucket.borrowed:
            bucket.release_pending = True  # _returned gives it back
            return
        self._give_back(bucket)

    def _give_back(self, bucket):
        """Releases a freed bucket's memory and returns its slot to the pool."""
        tensor, pool = bucket.slot.tensor, self.pool
        held = [a for a in (bucket.write_address, bucket.read_address) if a is not None]
        bucket.write_address = bucket.read_address = None
        for _ in held:
            tensor.release()
        clean = bucket.written or bucket.write_future is not None
        if self.device == "nvme" and clean:
            pool.give_later(bucket.slot, before=bucket.slot.tensor.evict)
        elif bucket.write_future is not None:
            pool.give_later(bucket.slot)
        else:
            pool.give(bucket.slot)

    def _returned(self, bucket):
        """The last tensor backward held over part of ``bucket`` is gone (a finalizer)."""
        bucket.borrowed -= 1
        if bucket.borrowed == 0 and bucket.release_pending:
            bucket.release_pending = False
            try:
                self._give_back(bucket)
            except Exception:  # noqa: BLE001 - a finalizer; the engine may be closed already
                pass

    def _drop(self, saved):
        """A _Saved no one refers to any more (autograd freed it)."""
        bucket = saved.bucket
        bucket.live -= 1
        if bucket.live == 0 and not bucket.freed and saved.forward.finished:
            try:
                self._free(bucket)
            except Exception:  # noqa: BLE001 - a destructor; the engine may be closed already
                bucket.freed = True

    # --- unpack ----------------------------------------------------------------------------

    def _unpack_one(self, saved):
        if isinstance(saved, _PagerSaved):
            return saved.pager._unpack(saved.packed)
        if not isinstance(saved, _Saved):
            return saved
        forward, bucket = saved.forward, saved.bucket
        if forward.raised or bucket.freed:
            raise FailedPrecondition(
                _capi.Status.FAILED_PRECONDITION,
                f"a saved activation of forward {forward.number} is gone: "
                + ("that forward raised, so its activations were freed; run it again"
                   if forward.raised else "its memory was given back already"))
        self._readable(forward, bucket)
        self._prefetch_before(forward, bucket)
        if saved.backend is None:  # a CPU model computes on the pinned memory itself
            raw = bucket.borrow(saved.offset, saved.nbytes, self._returned)
            return raw.view(saved.dtype).as_strided(saved.size, saved.stride)
        source = bucket.view(saved.offset, saved.nbytes).view(saved.dtype)
        source = source.as_strided(saved.size, saved.stride)
        out = torch.empty_strided(saved.size, saved.stride, dtype=saved.dtype,
                                  device=saved.device)
        event = saved.backend.copy_to_device(source, out)
        saved.backend.wait_current(event)
        bucket.copies_out.append(event)
        return out

    def _readable(self, forward, bucket):
        """Makes ``bucket`` readable, counting a prefetch hit or miss and the stall."""
        stats = forward.stats
        started = time.perf_counter()
        if bucket.write_address is not None:
            if bucket.backend is not None:
                bucket.end_copies(bucket.backend, bucket.copies_in)
            if not bucket.counted:
                stats["resident_hits"] += 1
                bucket.counted = True
        elif bucket.read_address is None:
            if bucket.in_prefetch:
                stats["prefetch_hits"] += 1
                forward.prefetch_budget_used -= bucket.slot.nbytes
                bucket.in_prefetch = False
            else:
                stats["prefetch_misses"] += 1
            bucket.acquire_for_read()
            stats["bytes_from_nvme"] += bucket.slot.nbytes
            self._raise_write_errors(forward)
        stats["stall_seconds"] += time.perf_counter() - started

    def _prefetch_before(self, forward, bucket):
        """Starts reading the buckets backward needs next (earlier ones, latest first) within
        prefetch_bytes, and lets go of later ones backward has passed."""
        for later in forward.buckets[bucket.index + 2:]:
            if later.read_address is not None and not later.freed and not later.borrowed:
                if later.backend is not None:
                    later.end_copies(later.backend, later.copies_out)
                later.read_address = None
                later.slot.tensor.release()
        for earlier in reversed(forward.buckets[:bucket.index]):
            if forward.prefetch_budget_used + earlier.slot.nbytes > self._prefetch_budget():
                return
            if earlier.freed or earlier.held or earlier.in_prefetch:
                continue
            if _pending(earlier.write_future):
                return  # still being written; the next unpack tries again
            earlier.slot.tensor.prefetch(_capi.Tier.HOST)
            earlier.in_prefetch = True
            forward.prefetch_budget_used += earlier.slot.nbytes

    # --- figures ---------------------------------------------------------------------------

    def stats(self):
        """Per iteration (forward and its backward; the latest 1000): tensors and bytes moved
        out (``bytes_to_host``: into pinned DRAM; ``bytes_to_nvme`` / ``bytes_from_nvme``:
        whole buckets written and read), saved tensors kept (below min_bytes), buckets, prefetch
        hits and misses (a bucket read from NVMe that a prefetch had started, or not), resident
        hits (a bucket backward found still in DRAM), stall_seconds (backward waiting for reads
        and copies) and peak_pinned_bytes; the pinned and prefetch budgets in effect; and the
        engine's activation slots."""
        return {
            "per_iteration": [dict(stats) for stats in self.iterations],
            "device": self.device,
            "bucket_bytes": self.bucket_bytes,
            "pinned_bytes": self._pinned_budget(),
            "prefetch_bytes": self._prefetch_budget(),
            "slots_registered": self.pool.registered,
            "slots_in_use": self.pool.in_use,
            "pinned_held_bytes": sum(self._pinned(forward) for forward in self._live_forwards()),
            "live_buckets": sum(_unreleased(bucket) for forward in self._live_forwards()
                                for bucket in forward.buckets),
        }

    def _live_forwards(self):
        """The forwards some of whose buckets are not freed yet (the others are forgotten)."""
        self._forwards = [forward for forward in self._forwards
                          if any(_unreleased(bucket) for bucket in forward.buckets)
                          or forward is self._forward]
        return self._forwards

    def wait_copies(self):
        """Waits for every device copy into the buckets issued so far (and, with device "nvme",
        hands the buckets they held back to the writer)."""
        for forward in self._live_forwards():
            for bucket in forward.buckets:
                if bucket.backend is not None and not bucket.freed:
                    bucket.end_copies(bucket.backend, bucket.copies_in)
            if self.device == "nvme":
                self._submit_writes(forward, block=True)

    def wait_writes(self):
        """Waits until every bucket handed to the writer so far is on NVMe (for tests and
        measurements)."""
        self.pool.drain()


def _unreleased(bucket):
    """Whether the bucket still holds its slot (not freed, or freed while borrowed)."""
    return not bucket.freed or bucket.release_pending


def _untraced(error):
    """A copy of a zoe.Error without its traceback (whose frames would keep the graph alive)."""
    return type(error)(error.code, error.message)


def _pending(future):
    return future is not None and not future.done()


def offload_activations(engine, device="auto", min_bytes=_MiB, device_backend=None,
                        bucket_bytes=None, pinned_bytes=None, prefetch_bytes=None):
    """``with offload_activations(engine, device="nvme"):`` around a forward moves the tensors
    autograd saves for backward out of memory (see the module docstring).

    ``device``: "nvme" (to NVMe through pinned DRAM), "cpu" (to pinned DRAM; a model on a
    GPU or the CPU twin) or "auto" ("cpu" for a model on a device, "nvme" for one on the CPU).
    ``min_bytes``: smaller saved tensors stay where they are. ``device_backend``: the
    DeviceBackend of a model whose tensors are CPU tensors standing in for device ones
    (``HostTwin``); CUDA tensors use CudaBackend. ``bucket_bytes``: the unit saved tensors are
    packed into and written in (whole chunks; default the engine's chunk size, at least 4 MiB).
    ``pinned_bytes``: pinned DRAM held at once (nvme: default four buckets, or the largest
    bucket seen and two more where that is more; cpu: the engine's tensor HOST budget).
    ``prefetch_bytes``: how far backward reads ahead (default two buckets, or the largest
    bucket seen and one more where that is more). A tensor larger than a bucket goes alone in a
    bucket its size."""
    return ActivationOffload(engine, device, min_bytes, device_backend, bucket_bytes,
                             pinned_bytes, prefetch_bytes)
