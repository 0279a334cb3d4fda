"""Where offloaded activations live: buckets of pinned DRAM that zoe tensors provide, written to
NVMe and read back through the engine's tiers (io_uring, a checksum on every swapped byte).

A zoe tensor cannot be unregistered, so the tensors are *slots*, registered once per engine and
reused: a slot of ``n`` chunks (its own chunk group, so it is one run the tiers move alone) goes
back to the engine's ``SlotPool`` when every activation in it has been used by backward (or its
forward raised) and is taken again by a later forward that needs ``n`` chunks. Swap space and
slots therefore grow to the most activations one iteration holds and stay there, never per
iteration.

A ``Bucket`` is one slot being filled with saved tensors in forward order (packed contiguously,
DeepSpeed's contiguous_memory_optimization); a tensor larger than a bucket gets a slot of its own.
Bucket life: *open* (acquired for writing, copies going in) -> *closed* (full; still acquired)
-> with device "nvme" *written* (released and evicted to NVMe by the pool's writer thread) ->
*read* in backward (acquired for reading, prefetched ahead in reverse order) -> *freed* (slot
back to the pool) once no saved tensor refers to it.

Thread-safety: SlotPool's methods take its lock (engine calls that wait, registration, run
without it). A Bucket is used by the thread running forward or backward; its write_back runs on
the writer thread after that thread has handed the bucket's write acquisition over.
"""

import concurrent.futures
import ctypes
import threading
import time
import weakref

import torch

from .. import _capi
from ..engine import whole_chunks
from ..errors import FailedPrecondition

_ALIGN = 256  # bytes between the starts of two tensors in a bucket
_POOLS_LOCK = threading.Lock()


def pool_for(engine):
    """The engine's SlotPool, created on first use and kept by the engine (an attribute: the
    pool's slots refer to the engine, so the two are collected together)."""
    with _POOLS_LOCK:
        pool = getattr(engine, "_zoe_activation_slots", None)
        if pool is None:
            pool = engine._zoe_activation_slots = SlotPool(engine)
        return pool


def aligned(nbytes, unit=_ALIGN):
    return -(-int(nbytes) // unit) * unit


class Slot:
    """A registered zoe tensor of ``chunks`` whole chunks (``nbytes``), homed on NVMe."""

    def __init__(self, serial, tensor, chunks, nbytes):
        self.serial = serial  # registration order
        self.tensor = tensor
        self.chunks = chunks
        self.nbytes = nbytes


class SlotPool:
    """The engine's activation slots by size (in chunks), free or in use, and the writer thread
    that evicts closed buckets to NVMe in the background."""

    def __init__(self, engine):
        self.engine = engine
        self.chunk_bytes = engine.chunk_bytes
        self.lock = threading.RLock()
        self._free = {}  # chunks -> [Slot]
        self.registered = 0  # slots registered so far
        self.in_use = 0
        self.returning = 0  # slots the writer thread is to give back (give_later)
        self._writer = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="zoe-activations")

    def take(self, nbytes):
        """A free slot of at least ``nbytes`` (whole chunks), registered when none is free. The
        free slot registered first is taken, so iterations of the same shapes use the same slots
        in the same order (what a trace recorded by the engine expects)."""
        chunks = max(1, whole_chunks(nbytes, self.chunk_bytes) // self.chunk_bytes)
        while True:
            with self.lock:
                free = self._free.get(chunks)
                if free:
                    self.in_use += 1
                    return free.pop(min(range(len(free)), key=lambda i: free[i].serial))
                if not self.returning:
                    serial = self.registered
                    self.registered += 1
                    break
            # A slot on its way back (its eviction queued on the writer thread) is waited for
            # rather than another registered: the pool does not grow with the writer's pace.
            self.drain()
        name = f"zoe.activations.{serial}"
        tensor = self.engine.register_tensor(name, chunks * self.chunk_bytes, _capi.DType.UINT8,
                                             _capi.Tier.NVME, group=name)
        with self.lock:
            self.in_use += 1
        return Slot(serial, tensor, chunks, chunks * self.chunk_bytes)

    def give(self, slot):
        """Returns a slot no activation refers to any more."""
        with self.lock:
            self._free.setdefault(slot.chunks, []).append(slot)
            self.in_use -= 1

    def give_later(self, slot, before=None):
        """Gives ``slot`` back on the writer thread (after everything submitted before it), once
        ``before()`` (its eviction, say) ran, whether that raised or not."""
        with self.lock:
            self.returning += 1

        def give():
            try:
                if before is not None:
                    before()
            finally:
                with self.lock:
                    self.returning -= 1
                self.give(slot)
        return self.background(give)

    def background(self, function):
        """Runs ``function`` on the writer thread (in submission order); returns its Future."""
        return self._writer.submit(function)

    def drain(self):
        """Waits for everything submitted to the writer thread so far."""
        self._writer.submit(lambda: None).result()

    def free_slots(self):
        with self.lock:
            return sum(len(slots) for slots in self._free.values())


def host_view(address, nbytes):
    """A uint8 CPU tensor over ``nbytes`` of zoe memory at ``address`` (borrowed)."""
    return torch.frombuffer((ctypes.c_char * nbytes).from_address(address), dtype=torch.uint8)


class Bucket:
    """One slot being filled by, then read back for, one forward (see the module docstring).

    ``live``: saved tensors (handles) that still refer to the bucket; the bucket is freed when it
    drops to 0 after the bucket was closed. ``copies``: device copies into or out of its memory
    not yet ended (their events), which must end before the memory is released."""

    def __init__(self, store, index, slot):
        self.store = store
        self.index = index  # position in its forward, 0 first
        self.slot = slot
        self.used = 0
        self.live = 0
        self.closed = self.freed = False
        self.written = False  # on NVMe (evicted after its write)
        self.write_future = None
        self.write_address = slot.tensor.acquire(_capi.Tier.HOST, _capi.Access.WRITE)
        self.read_address = None
        self.backend = None  # the DeviceBackend of its copies; None for a CPU model
        self.in_prefetch = False  # a prefetch was started and backward has not read it yet
        self.counted = False  # backward's first read of it was counted in the statistics
        self.borrowed = 0  # tensors backward holds over its memory (borrow)
        self.release_pending = False  # freed while borrowed: released when the last returns
        self.copies_in = []  # events of device -> host copies into the bucket
        self.copies_out = []  # events of host -> device copies out of it

    @property
    def held(self):
        """Whether this bucket pins its slot's HOST memory."""
        return self.write_address is not None or self.read_address is not None

    def place(self, nbytes):
        """The offset of ``nbytes`` more in the bucket, or None when they do not fit."""
        offset = aligned(self.used)
        if self.closed or offset + nbytes > self.slot.nbytes:
            return None
        self.used = offset + nbytes
        return offset

    def _address(self):
        address = self.write_address if self.write_address is not None else self.read_address
        if address is None:
            raise FailedPrecondition(_capi.Status.FAILED_PRECONDITION,
                                     f"activation bucket {self.index} is not resident")
        return address

    def view(self, offset, nbytes):
        """The bucket's bytes [offset, offset + nbytes) as a uint8 CPU tensor (borrowed: valid
        while the bucket holds its memory)."""
        return host_view(self._address() + offset, nbytes)

    def borrow(self, offset, nbytes, on_return):
        """The same bytes as a uint8 CPU tensor whose views keep the memory held: when the last
        of them is gone, ``on_return(self)`` runs (from whichever thread drops it)."""
        array = (ctypes.c_char * nbytes).from_address(self._address() + offset)
        self.borrowed += 1
        weakref.finalize(array, on_return, self)
        return torch.frombuffer(array, dtype=torch.uint8)

    def end_copies(self, backend, events):
        """Waits for ``events`` (a list, emptied) of ``backend``."""
        while events:
            backend.wait(events.pop(0))

    def write_back(self):
        """On the writer thread: releases the bucket's write acquisition and evicts it to NVMe."""
        self.slot.tensor.release()
        self.slot.tensor.evict()

    def acquire_for_read(self):
        """Makes the bucket readable (read back from NVMe when it was written); returns the
        seconds spent waiting."""
        started = time.perf_counter()
        if self.write_future is not None:
            future, self.write_future = self.write_future, None
            future.result()  # its error was reported by the store already, or is raised here
            self.written = True
        if self.write_address is None and self.read_address is None:
            self.read_address = self.slot.tensor.acquire(_capi.Tier.HOST, _capi.Access.READ)
        return time.perf_counter() - started
