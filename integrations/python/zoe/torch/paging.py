"""zoe.torch.offload_parameters: ZeRO-3-style paging of a module's parameters through a zoe
engine, by module hooks and saved-tensor hooks, with trace-driven prefetch."""

import contextlib

import torch

from .. import _capi
from ..errors import FailedPrecondition
from .adoption import adopt, check_adoptable, init_record, placeholder_for, write_new_tensor
from .common import _PAGED_DTYPES, _invalid
from .device import check_paging_tier, wrap_tier_memory
from .external_reads import (ForwardFrames, end_frames_when_raising, stop_ending_frames,
                             unwatch_reads, watch_reads)
from .stage3_checks import refuse_placeholder_load, refuse_placeholder_state_dict


def _storage_pointer(tensor):
    """The address of the storage a tensor views (views of one storage share it)."""
    storage = tensor.untyped_storage() if hasattr(tensor, "untyped_storage") else tensor.storage()
    return storage.data_ptr()


class _PagedParam:
    """One parameter paged through a zoe tensor: how often it is acquired and the view of the
    acquired memory that param.data points at meanwhile."""

    def __init__(self, name, param, tensor, placeholder, tier=_capi.Tier.HOST):
        self.name = name
        self.tier = tier  # HOST, or DEVICE (HOST as staging)
        self.device = placeholder.device
        self.param = param
        self.tensor = tensor
        self.placeholder = placeholder
        self.shape = param.shape
        self.dtype = param.dtype
        self.holds = 0  # forward and materialise holds
        self.backward_holds = 0  # acquisitions made while unpacking saved tensors
        self.view = None
        self.address = None

    def acquire(self, access):
        """One zoe acquire; the first one points param.data at the acquired memory."""
        address = self.tensor.acquire(self.tier, access)
        if self.view is None:
            self.address = address
            flat = wrap_tier_memory(
                address, self.tensor.nbytes, self.dtype, self.device
            )
            self.view = flat.view(self.shape)
            self.param.data = self.view
        elif address != self.address:
            self.tensor.release()
            raise FailedPrecondition(
                _capi.Status.FAILED_PRECONDITION,
                f"parameter {self.name!r} moved while acquired ({self.address:#x} -> "
                f"{address:#x})",
            )
        return self.view

    def release_one(self):
        """One zoe release; the last one points param.data back at the placeholder."""
        if self.holds + self.backward_holds == 0:
            self.param.data = self.placeholder
            self.view = self.address = None
        self.tensor.release()


class ParameterPager:
    """The handle offload_parameters returns: paging statistics, materialisation, removal."""

    def __init__(self, model, engine, trace_name, home, tier=_capi.Tier.HOST):
        self.model = model
        self.engine = engine
        self.trace_name = trace_name
        self.home = home
        self.tier = tier
        self.iterations = 0
        self.iteration_stats = []  # per completed iteration: prefetch hits/misses, stall, bytes
        self._records = {}  # id(param) -> _PagedParam
        self._by_address = {}  # storage address -> _PagedParam, while acquired
        self._handles = []
        self._in_iteration = False
        self._saved_hooks = None
        self._backward_end_queued = False
        self._snapshot = None  # prefetch counters when the current iteration began
        self._frames = ForwardFrames()  # forwards running now, with the parameters read in them
        self._watched = []  # (module, the type of its _parameters before watch_reads)
        self._forward_wrapper = None  # end_frames_when_raising's, on the model
        self._root_forward_running = False  # the model's forward (not a recomputation)
        self._full_values = 0  # > 0 while state_dict() or materialized() hold full values

    # --- registration ----------------------------------------------------------------------

    def _register(self, prefix):
        """Pages every parameter of the model once (a weight tied to several modules once):
        one zero_init paged is adopted (its zoe tensor taken over), any other is registered
        as ``prefix`` + its name and written."""
        named = _distinct_named_parameters(self.model)
        check_adoptable(named, self.engine, self.home)
        devices_checked = set()
        for name, param in named:
            if param.numel() == 0:
                continue  # nothing to page
            if param.dtype not in _PAGED_DTYPES:
                raise _invalid(f"parameter {name!r}: {param.dtype} cannot be paged")
            if param.device not in devices_checked:
                check_paging_tier(self.engine, self.tier, param.device)
                devices_checked.add(param.device)
            record = self._adopt(name, param) or self._page(prefix + name, name, param)
            param._zoe_pager = self
            self._records[id(param)] = record

    def _page(self, tensor_name, name, param):
        """A record of ``param`` paged through a new zoe tensor; param.data the placeholder."""
        tensor = write_new_tensor(self.engine, tensor_name, param, self.home)
        placeholder = placeholder_for(param.shape, param.dtype, param.device)
        param.data = placeholder
        return _PagedParam(name, param, tensor, placeholder, self.tier)

    def _adopt(self, name, param):
        """A record of ``param`` when zero_init paged it (its tensor and placeholder taken
        over), else None."""
        init = adopt(name, param) if init_record(param) is not None else None
        if init is None:
            return None
        return _PagedParam(name, param, init.tensor, init.placeholder, self.tier)

    def _install_hooks(self):
        # The root's own parameters are held by the iteration hooks, inside the trace.
        self._root_records = self._direct_records(self.model)
        self._handles.append(self.model.register_forward_pre_hook(self._root_pre_hook))
        self._handles.append(self.model.register_forward_hook(self._root_post_hook))
        self._install_module_hooks(self._direct_records)
        self._install_state_dict_checks()
        for record in self._records.values():
            if record.param.requires_grad:
                self._handles.append(record.param.register_hook(self._grad_hook(record)))
        self._watch_reads()

    def _install_module_hooks(self, direct_items):
        """The forward hooks of every module but the model (each forward is a frame): the
        pre-hook holds ``direct_items(module)``, its own paged parameters."""
        for module in self.model.modules():
            if module is not self.model:
                self._handles.append(
                    module.register_forward_pre_hook(self._pre_hook(direct_items(module))))
                self._handles.append(module.register_forward_hook(self._module_post_hook))

    def _install_state_dict_checks(self):
        """On each module that owns a paged parameter: its state_dict() and the loading of
        those parameters by load_state_dict() are refused while they are placeholders
        (stage3_checks); where this torch lacks the hooks, nothing is installed."""
        for module in self.model.modules():
            names = [name for name, param in module._parameters.items()
                     if param is not None and self._item_of(param) is not None]
            if not names:
                continue
            if hasattr(module, "_register_state_dict_hook"):
                self._handles.append(module._register_state_dict_hook(
                    refuse_placeholder_state_dict(self)))
            if hasattr(module, "_register_load_state_dict_pre_hook"):
                self._handles.append(module._register_load_state_dict_pre_hook(
                    refuse_placeholder_load(self, names)))

    def placeholders_in_state_dict(self):
        """Whether the model's state_dict() would now hold placeholders: outside
        materialized() and this pager's state_dict()."""
        return self._full_values == 0

    @contextlib.contextmanager
    def _full_values_held(self):
        """A block in which the model's parameters hold their values (materialized()) or the
        state dict gets them (state_dict()): its state_dict hooks let it be."""
        self._full_values += 1
        try:
            yield
        finally:
            self._full_values -= 1

    def _watch_reads(self):
        """Watches the reads by name of the paged parameters of every module that holds one,
        and ends the frames of a forward that raises (external_reads)."""
        for module in self.model.modules():
            if any(self._item_of(param) is not None
                   for param in module.parameters(recurse=False)):
                self._watched.append((module, watch_reads(module, self._on_parameter_read)))
        self._forward_wrapper = end_frames_when_raising(self.model, self._forward_raised)

    def _forward_raised(self):
        self._frames.end_all(self._release_after_forward)
        self._root_forward_running = False

    def _on_parameter_read(self, param):
        """A parameter was read by name: while a forward runs, a paged one the innermost
        forward does not hold (read outside its own module's forward, or present only because
        another forward or the keep holds it) is acquired for it."""
        if not self._frames.running():
            return
        item = self._item_of(param)
        if item is not None and not self._frames.holds(item):
            self._hold_for_forward(item)
            self._frames.add(item)

    def _item_of(self, param):
        """The record of a parameter this pager pages, or None."""
        return self._records.get(id(param))

    def _hold_for_forward(self, record):
        self._hold(record, _capi.Access.READ)

    def _release_after_forward(self, record):
        if not self._hold_for_backward_if_recomputing(record):
            self._unhold(record)

    def _hold_for_backward_if_recomputing(self, item):
        """A forward recomputed in backward (activation checkpointing) ended: autograd saved
        what it read of ``item`` without the pack hooks, so its hold passes to backward (its
        gradient hook, or the end of the iteration, releases it) rather than letting its
        memory go while backward still reads it. Returns whether it did."""
        if self._root_forward_running or not self._in_iteration:
            return False
        item.holds -= 1
        item.backward_holds += 1
        return True

    def _direct_records(self, module):
        return [
            self._records[id(p)]
            for p in module.parameters(recurse=False)
            if id(p) in self._records
        ]

    # --- acquisition -----------------------------------------------------------------------

    def _hold(self, record, access, backward=False):
        view = record.acquire(access)
        if backward:
            record.backward_holds += 1
        else:
            record.holds += 1
        self._by_address[_storage_pointer(view)] = record
        return view

    def _unhold(self, record, backward=False):
        if backward:
            record.backward_holds -= 1
        else:
            record.holds -= 1
        address = _storage_pointer(record.view)
        record.release_one()
        if record.view is None:
            self._by_address.pop(address, None)

    def _pre_hook(self, items):
        def hook(module, inputs):
            self._frames.begin(module)
            for item in items:
                self._hold_for_forward(item)
                self._frames.add(item)
        return hook

    def _module_post_hook(self, module, inputs, output):
        self._frames.end(module, self._release_after_forward)

    # Saved tensors that live in acquired parameter memory are packed as a reference to the
    # parameter and re-acquired when backward unpacks them; the parameter's gradient hook (or
    # the end of backward) releases what backward acquired. A parameter that takes no gradient
    # (requires_grad False) has no gradient hook: its unpacked values are a copy, and its
    # acquisition is released at once rather than held to the end of backward.
    def _pack(self, tensor):
        record = self._by_address.get(_storage_pointer(tensor)) if tensor.numel() else None
        if record is None:
            return tensor
        return (record, tensor.dtype, tensor.size(), tensor.stride(), tensor.storage_offset())

    def _unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        record, dtype, size, stride, offset = packed
        frozen = not record.param.requires_grad
        view = self._hold(record, _capi.Access.READ, backward=not frozen)
        flat = view.view(-1)
        if dtype != flat.dtype:
            flat = flat.view(dtype)
        values = flat.as_strided(size, stride, offset)
        if frozen:
            values = values.clone()
            self._unhold(record)
        return values

    def _grad_hook(self, record):
        def hook(grad):
            self._queue_backward_end()
            while record.backward_holds:
                self._unhold(record, backward=True)
            return grad
        return hook

    # --- iterations ------------------------------------------------------------------------

    def _root_pre_hook(self, module, inputs):
        self._frames.end_all(self._release_after_forward)  # left by a forward that raised
        if self._saved_hooks is not None:  # the previous forward raised
            self._saved_hooks.__exit__(None, None, None)
            self._saved_hooks = None
        if self._in_iteration:
            self._end_iteration()  # the previous forward had no backward
        self._snapshot = self._prefetch_counters()
        self.engine.trace_begin(self.trace_name)
        self._in_iteration = True
        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._saved_hooks.__enter__()
        self._frames.begin(module)
        for record in self._root_records:
            self._hold(record, _capi.Access.READ)
            self._frames.add(record)
        self._root_forward_running = True

    def _root_post_hook(self, module, inputs, output):
        self._frames.end(module, self._release_after_forward)
        self._root_forward_running = False
        if self._saved_hooks is not None:
            self._saved_hooks.__exit__(None, None, None)
            self._saved_hooks = None
        tensors = [t for t in _tensors_in(output) if t.requires_grad]
        if not tensors:
            self._end_iteration()
            return
        self._backward_end_queued = False
        for tensor in tensors:
            tensor.register_hook(self._output_grad_hook)

    def _output_grad_hook(self, grad):
        self._queue_backward_end()
        return grad

    def _queue_backward_end(self):
        if not self._backward_end_queued and self._in_iteration:
            self._backward_end_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_iteration)

    def _end_iteration(self):
        if not self._in_iteration:
            return
        self._frames.end_all(self._release_after_forward)  # left by a recomputation stopped early
        for record in self._records.values():
            while record.backward_holds:
                self._unhold(record, backward=True)
        self.engine.trace_end()
        self._in_iteration = False
        now = self._prefetch_counters()
        before = self._snapshot
        delta = {key: now[key] - before[key] for key in now}
        lookups = delta["hits"] + delta["misses"]
        delta["hit_rate"] = delta["hits"] / lookups if lookups else 1.0
        self.iteration_stats.append(delta)
        self.iterations += 1

    def _prefetch_counters(self):
        stats = _tier_stats(self.engine.stats())
        prefetch = stats.get("prefetch", {})
        links = stats.get("links", {})
        return {
            "hits": prefetch.get("hits", 0),
            "misses": prefetch.get("misses", 0),
            "stall_ns": stats.get("stall", {}).get("nanoseconds", 0),
            "nvme_to_host_bytes": links.get("nvme_to_host", {}).get("bytes", 0),
            "host_to_nvme_bytes": links.get("host_to_nvme", {}).get("bytes", 0),
        }

    # --- what users call -------------------------------------------------------------------

    def prefetch_hit_rate(self, skip_first=True):
        """Hits / (hits + misses) over the completed iterations (after the recorded first one
        when ``skip_first``); 1.0 when nothing was looked up."""
        stats = self.iteration_stats[1:] if skip_first else self.iteration_stats
        hits = sum(s["hits"] for s in stats)
        lookups = hits + sum(s["misses"] for s in stats)
        return hits / lookups if lookups else 1.0

    def stats(self):
        """Paging figures: iterations, per-iteration prefetch hits, misses, stall and bytes,
        the hit rate after the first iteration, and the engine's statistics."""
        return {
            "iterations": self.iterations,
            "per_iteration": list(self.iteration_stats),
            "prefetch_hit_rate": self.prefetch_hit_rate(),
            "engine": self.engine.stats(),
        }

    def _record_of(self, param):
        """The record of a paged parameter (or shard); InvalidArgument for a tensor this pager
        does not page (a parameter added to the model after it was paged)."""
        record = self._records.get(id(param))
        if record is None:
            raise _invalid(f"a tensor of shape {tuple(param.shape)} is not paged: a parameter "
                           "added to the model after it was paged (offload_parameters, or "
                           "zoe.torch.initialize at stage 3) is neither paged nor trained; add "
                           "parameters before, and build the engine again")
        return record

    @contextlib.contextmanager
    def held(self, param, access=_capi.Access.READ):
        """One parameter acquired in the pager's tier for the block (param.data points at it
        meanwhile); yields the tensor over its memory (see _record_of for the error)."""
        record = self._record_of(param)
        view = self._hold(record, access)
        try:
            yield view
        finally:
            self._unhold(record)

    @contextlib.contextmanager
    def held_on_host(self, param, access=_capi.Access.READ):
        """One parameter's values in host memory for the block, whatever the pager's tier: a
        CPU tensor over the HOST copy of its zoe tensor, which zoe may read and write itself
        (the optimizer's step and master weights use it). With the DEVICE tier, a copy there
        that was written is copied down first, and a write here drops the copy there (the next
        forward brings the new values up). While this pager holds parameters in the device
        tier (inside materialized(), say), whose chunks' HOST copies cannot be taken then, it
        is a host copy of the parameter held there instead, copied back after a write. With
        the HOST tier it is ``held``."""
        if self.tier == _capi.Tier.HOST:
            with self.held(param, access) as view:
                yield view
            return
        record = self._record_of(param)
        if self._by_address:
            with self._staged_on_host(param, access) as values:
                yield values
            return
        address = record.tensor.acquire(_capi.Tier.HOST, access)
        try:
            flat = wrap_tier_memory(address, record.tensor.nbytes, record.dtype,
                                    torch.device("cpu"))
            yield flat.view(record.shape)
        finally:
            record.tensor.release()

    @contextlib.contextmanager
    def _staged_on_host(self, param, access):
        """held_on_host through a host copy of the parameter held in the pager's tier (its
        values, also for a write: what the writer leaves unwritten stays as it was)."""
        reads_only = access == _capi.Access.READ
        with self.held(param, access if reads_only else _capi.Access.READ_WRITE) as view:
            values = view.to("cpu", copy=True)
            yield values
            if not reads_only:
                view.copy_(values)

    @contextlib.contextmanager
    def materialized(self, access=_capi.Access.READ_WRITE):
        """Every parameter acquired and readable (writable with READ_WRITE) for the block: for a
        torch optimizer's step, saving the model, or code that reads parameters directly. All
        parameters must fit the tensors' HOST budget at once (else the acquire waits and then
        raises zoe.Busy); zoe.torch optimizers do not need it (they acquire one parameter at a
        time)."""
        held = []
        try:
            for record in self._records.values():
                self._hold(record, access)
                held.append(record)
            with self._full_values_held():
                yield self.model
        finally:
            for record in reversed(held):
                self._unhold(record)

    def state_dict(self):
        """model.state_dict() with every paged parameter's values (copies, acquired one at a
        time, so the model need not fit in DRAM at once) instead of its placeholder."""
        with self._full_values_held():
            state = self.model.state_dict()
        for module_name, module in self.model.named_modules():
            for name, param in module._parameters.items():
                key = f"{module_name}.{name}" if module_name else name
                if param is not None and id(param) in self._records and key in state:
                    with self.held(param) as values:
                        state[key] = values.clone()
        return state

    def _unwatch_reads(self):
        for module, original in self._watched:
            unwatch_reads(module, original)
        self._watched = []
        stop_ending_frames(self.model, self._forward_wrapper)

    def remove(self):
        """Removes the hooks and gives every parameter back its data as an ordinary tensor."""
        if self._in_iteration:
            self._end_iteration()
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._unwatch_reads()
        with torch.no_grad():
            for record in self._records.values():
                view = self._hold(record, _capi.Access.READ)
                copy = view.clone()
                self._unhold(record)
                record.param.data = copy
                del record.param._zoe_pager
        self._records.clear()


def _distinct_named_parameters(model):
    """(name, parameter) for each parameter of ``model`` once, by its first name."""
    named, seen = [], set()
    for name, param in model.named_parameters():
        if id(param) not in seen:
            seen.add(id(param))
            named.append((name, param))
    return named


def _tier_stats(stats):
    """The tier manager's statistics inside the engine's (where prefetch counters live)."""
    if "prefetch" in stats:
        return stats
    for value in stats.values():
        if isinstance(value, dict) and "prefetch" in value:
            return value
    return {}


def _tensors_in(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors_in(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors_in(item)
