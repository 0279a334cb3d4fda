"""ZeRO stage 3 for zoe.torch.offload_parameters(model, engine, process_group=pg): every
parameter partitioned across the ranks of a torch.distributed process group, each rank paging
only its own shard through its own engine's tiers.

Layout: each parameter, flattened, is cut into N contiguous element shards,
shard r = [floor(r * n / N), floor((r + 1) * n / N)) (distributed.shard_bounds, as for the stage 1
and 2 optimizer), so uneven sizes differ by at most one element and a parameter smaller than N
leaves some shards empty. Sharding each parameter on its own (rather than a flat concatenation)
lets a module gather exactly its own parameters. Rank r's shard of a parameter is a leaf tensor
(``pager.shard_parameters()``) paged through rank r's engine like a ParameterPager's parameter;
``zoe.torch.AdamW(pager.shard_parameters(), engine=...)`` is the stage 3 optimizer (a torch
optimizer steps the shards inside ``with pager.shards_materialized():``, which acquires this
rank's shards, or inside ``with pager.materialized():``).
- ``pager.materialized()``: every parameter gathered in full for the block (a collective: every
  rank enters it; the whole model is held at once), this rank's shards acquired too. With
  READ_WRITE each rank writes its own slice of each full parameter written inside back to its
  shard at exit (so ``model.load_state_dict(...)`` inside, on every rank, loads the model);
  leaving is agreed: a block that raised on any rank keeps nothing on any rank.

- Forward: a module's pre-hook gathers its own parameters (each rank's shard broadcast as bytes
  into its place in the full parameter, so any dtype travels over gloo: _collective_ops) and points
  ``param.data`` at the full values; its post-hook frees them, or keeps them gathered for
  backward when autograd saved them and the keep policy allows (stage3_keep.py: DeepSpeed's
  stage3_max_live_parameters and stage3_max_reuse_distance; by default nothing is kept).
  Backward: tensors autograd saved from a gathered parameter are packed as a reference and,
  unless still kept, gathered again when backward unpacks them; the parameter's gradient
  accumulator hook frees them.
- Trace: the first iteration records the order in which parameters are gathered (forward and
  backward); later iterations issue the next ``prefetch_depth`` gathers of that order ahead
  with ``async_op=True`` and wait on a handle only when its parameter is needed. Every rank
  runs the same hooks in the same order, so every rank issues the same collectives. An order
  that differs from the trace re-records it.
- Gradients, in buckets: when a parameter's full gradient is accumulated, it leaves
  ``param.grad``, flat and in fp32 (an fp32 gradient itself, any other a copy). One of
  ``bucket_elements`` elements or more (default DEFAULT_BUCKET_ELEMENTS, as the stage 1 and 2
  optimizer's; 0 or 1: one parameter per bucket) is a bucket alone, reduced from its own memory;
  a smaller one joins the pending bucket, which is reduced once it holds ``bucket_elements``
  elements or more. A bucket's sum over the ranks starts as one
  _collective_ops.reduce_parts (``async_op=True``): part r, which rank r owns, is every bucketed
  parameter's shard r side by side in hook order (rank-major, so each part is contiguous however
  the parameters are cut). At most distributed.REDUCTIONS_IN_FLIGHT buckets are in flight, the
  oldest finished first; the end of backward reduces the partly filled bucket and finishes the rest.
  Each parameter's slice of this rank's part, divided by N (the mean, as
  DistributedDataParallel), is added to its shard's ``.grad``: the same sum and division per
  element as one reduction per parameter (at N = 2 bit for bit; from N = 3 gloo's ring adds an
  element's terms in an order set by its place in the reduced buffer, so a bucket may round a
  sum differently in its last bit). The buckets follow the hooks' order, which is the same
  on every rank; like DistributedDataParallel without find_unused_parameters, every rank must
  produce gradients for the same parameters in an iteration (a parameter unused on every rank
  in an iteration is simply skipped, and the optimizer skips it as torch does).
- Clipping and the inf/NaN skip: a zoe optimizer over the shards takes each shard's reduced
  gradient through its gradient sink (``set_gradient_sink``) into its streamed gradient store
  (grad_stream.py) instead of ``.grad``; its step all-reduces the squared norms (one collective of
  one float64), so every rank clips by the same global norm and skips a non-finite step together
  (``max_grad_norm``, or the engine's gradient_clipping). Without such an optimizer the reduced
  gradients land in the shards' ``.grad``, and ``pager.clip_grad_norm_(max_norm)`` clips them by
  the global norm (refused, naming ``max_grad_norm``, once an optimizer streams them);
  ``any_gradient_nonfinite()`` asks the same of ``.grad`` with one all-reduce of a flag.
- Checkpoints: ``pager.save_checkpoint(dir, optimizer)`` saves every rank's shards through its
  optimizer (master weights, moments, step counts), and the values of the shards no param group
  holds (frozen parameters) beside them, as one sharded checkpoint whose manifest names
  each rank's save (ranks killed during a save all load the previous one:
  checkpoint.save_sharded); ``pager.load_checkpoint(dir, optimizer)`` restores them on the same
  world size. Each step of both is agreed: one rank's failure raises on every rank, naming it.
- Failures: a collective that fails or times out (``init_process_group(timeout=...)`` bounds the
  wait for a rank that died) raises zoe.Aborted naming the collective and the parameter (for a
  gradient bucket of several, their names). A rank that cannot read its shard for a gather still
  makes the gather, and each gather carries an Agreement (one all-reduce of a failure flag per
  rank, issued with it): every rank raises when it is waited for, naming that rank and the
  parameter, and the ranks stay paired; writing the shards at registration is agreed too. The
  optimizer's step over the shards is agreed as well (zoe.torch.AdamW.step): when it fails on one
  rank every rank raises naming it; the others have taken the step, so every rank resumes from a
  checkpoint.
"""

import contextlib
import math

import torch
import torch.distributed as dist

from .. import _capi
from .._collective_ops import (Agreement, agreed, agreement_error, gather_objects, gather_parts,
                              reduce_parts, transport_failure_aborted)
from ..errors import FailedPrecondition, as_zoe_error
from .adoption import adopt, check_adoptable, init_record, placeholder_for, write_new_tensor
from .checkpoint import load_shard, read_manifest, save_sharded, shard_directory
from .common import _PAGED_DTYPES, _invalid, _live_group, _timed, _weak_group, whole_count
from .device import check_paging_tier
from .distributed import (DEFAULT_BUCKET_ELEMENTS, ReductionsInFlight, TorchCollectives,
                          shard_counts)
from .frozen_values import load_with_frozen, save_with_frozen
from .grad_hooks import on_gradient_accumulated
from .paging import ParameterPager, _distinct_named_parameters, _PagedParam, _storage_pointer
from .stage3_keep import KeptForBackward

DEFAULT_PREFETCH_DEPTH = 2
NAMES_IN_ERRORS = 8  # a failed bucket's error names this many of its parameters, then counts


class _PendingGather:
    """A gather of one parameter's shards in flight (``async_op=True``) with the agreement that
    every rank could read its shard and gathers the same parameter."""

    def __init__(self, handle, gathered, agreement, error):
        self.handle = handle
        self.gathered = gathered  # the full parameter, as bytes (every rank's shard in order)
        self.agreement = agreement  # _collective_ops.Agreement, in flight
        self.error = error  # why this rank could not read its shard, or None


class _GradientBucket:
    """Gradients summed over the ranks by one reduce_parts: part r is the shard-r slice of each
    gradient, side by side in the order they were bucketed, and rank r owns it."""

    def __init__(self, gradients, world_size):
        self.entries = [entry for entry, _ in gradients]
        shards = [total.split(entry.counts) for entry, total in gradients]
        if len(shards) == 1:
            self.parts = list(shards[0])  # one parameter: its own gradient, no copy
        else:
            sizes = [sum(entry.counts[r] for entry in self.entries) for r in range(world_size)]
            device = gradients[0][1].device
            flat = torch.empty(sum(sizes), dtype=torch.float32, device=device)
            self.parts = list(flat.split(sizes))
            for rank, part in enumerate(self.parts):
                torch.cat([shard[rank] for shard in shards], out=part)
        self.handle = None

    def reduction(self):
        """What this bucket's reduction is, naming its parameters (for a failure's message)."""
        if len(self.entries) == 1:
            return f"reduction of the gradient of parameter {self.entries[0].name!r}"
        names = ", ".join(repr(entry.name) for entry in self.entries[:NAMES_IN_ERRORS])
        more = len(self.entries) - NAMES_IN_ERRORS
        return (f"reduction of the gradients of the bucket of {len(self.entries)} parameters "
                f"{names}" + (f" and {more} more" if more > 0 else ""))


class _ShardedParam:
    """One parameter: its shard on this rank and, while gathered, its full values."""

    def __init__(self, index, name, param, counts, rank):
        self.index = index
        self.name = name
        self.param = param
        self.shape = param.shape
        self.dtype = param.dtype
        self.element_size = param.element_size()
        self.counts = counts  # elements of each rank's shard
        self.begin = sum(counts[:rank])
        self.count = counts[rank]
        self.shard = None  # this rank's shard as a leaf tensor (None when empty)
        self.placeholder = None
        self.full = None  # the gathered values, while gathered
        self.bytes = sum(counts) * self.element_size
        self.holds = 0  # forward's, and one while kept for backward (stage3_keep)
        self.backward_holds = 0
        self.saved = False  # autograd saved its gathered values in this iteration's forward


class ShardedParameterPager(ParameterPager):
    """The handle offload_parameters(..., process_group=pg) returns: the shard tensors to
    optimize, gathering statistics, clipping across ranks and removal."""

    def __init__(self, model, engine, trace_name, home, tier, process_group, prefetch_depth,
                 bucket_elements=DEFAULT_BUCKET_ELEMENTS, keep=None):
        super().__init__(model, engine, trace_name, home, tier)
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self._group = _weak_group(process_group)  # see group
        self.prefetch_depth = int(prefetch_depth)
        self.bucket_elements = int(bucket_elements)
        self._keep = keep or KeptForBackward()  # full parameters kept from forward to backward
        self._params = []  # _ShardedParam in registration order
        self._by_param = {}  # id(param) -> _ShardedParam
        self._full_by_address = {}  # storage address of gathered values -> _ShardedParam
        self._pending = {}  # _ShardedParam -> _PendingGather
        self._trace = None  # gather order recorded in the first iteration (indices)
        self._events = []  # gather order of the current iteration
        self._cursor = 0
        self._accumulator_nodes = []
        self._bucket = []  # (entry, flat fp32 gradient) waiting for the bucket to fill
        self._bucket_size = 0  # elements in self._bucket
        self._reductions = ReductionsInFlight()  # of _GradientBucket
        self._gradient_sinks = {}  # id(shard) -> sink(shard, grad) taking its reduced gradient
        # kept: uses that found the parameter still gathered only because it was kept
        # (stage3_keep), each a gather saved
        self.gathers = {"prefetched": 0, "on_demand": 0, "rerecorded": 0, "kept": 0}
        self.reductions = {"issued": 0, "parameters": 0}  # buckets reduced, gradients in them
        self.shard_bytes = 0  # bytes of this rank's shards (paged through its engine)
        self.gathered_bytes = 0  # bytes of full parameters gathered now
        self.in_flight_bytes = 0  # bytes of all-gathers issued and not yet waited for
        self.peak_gathered_bytes = 0  # the peak of the two together
        self.collective_seconds = 0.0  # wall time blocked in collectives: issuing and waiting
        self.gather_seconds = 0.0  # the part of it spent on gathers
        self.reduction_seconds = 0.0  # the part of it spent on gradient reductions
        self._root_records = []  # the base class's root holds: shards are held by gathers

    @property
    def group(self):
        """The process group. Held weakly: the pager (kept by the model's hooks) never keeps it
        past destroy_process_group(); a collective afterwards raises FailedPrecondition."""
        return _live_group(self._group, "the sharded parameter pager")

    # --- registration ----------------------------------------------------------------------

    def _register(self, prefix):
        """Checks every parameter, then shards them: a parameter that cannot be paged leaves
        the model untouched. A parameter zero_init paged is adopted: its shard is already
        paged."""
        named, devices_checked = [], set()
        distinct = _distinct_named_parameters(self.model)
        check_adoptable(distinct, self.engine, self.home, self.rank, self.world_size)
        for name, param in distinct:
            if param.numel() == 0:
                continue
            if param.dtype not in _PAGED_DTYPES:
                allowed = ", ".join(str(dtype) for dtype in _PAGED_DTYPES)
                raise _invalid(
                    f"parameter {name!r}: {param.dtype} cannot be paged; allowed: {allowed}"
                )
            if param.device not in devices_checked:
                check_paging_tier(self.engine, self.tier, param.device)
                devices_checked.add(param.device)
            named.append((name, param))
        for name, param in named:
            self._register_one(prefix, name, param)

    def _register_one(self, prefix, name, param):
        numel = param.numel()
        counts = shard_counts(numel, self.world_size)
        entry = _ShardedParam(len(self._params), name, param, counts, self.rank)
        init = adopt(name, param) if init_record(param) is not None else None
        if init is not None:
            entry.placeholder = init.placeholder
            if entry.count:
                placeholder = placeholder_for(entry.count, param.dtype, param.device)
                entry.shard = self._shard_leaf(prefix + name, init.tensor, placeholder, param)
        else:
            flat = param.detach().contiguous().view(-1)
            if entry.count:
                entry.shard = self._page_shard(
                    prefix + name, flat[entry.begin : entry.begin + entry.count], param
                )
            entry.placeholder = placeholder_for(param.shape, param.dtype, param.device)
            param.data = entry.placeholder
        param._zoe_sharded_pager = self
        self._params.append(entry)
        self._by_param[id(param)] = entry

    def _page_shard(self, name, values, param):
        """A leaf tensor over ``values`` (this rank's slice) paged through the engine."""
        tensor = write_new_tensor(self.engine, name, values, self.home)
        placeholder = placeholder_for(values.numel(), param.dtype, param.device)
        return self._shard_leaf(name, tensor, placeholder, param)

    def _shard_leaf(self, name, tensor, placeholder, param):
        """The leaf tensor of this rank's shard of ``param``, paged through ``tensor``, its data
        ``placeholder`` while not acquired."""
        shard = torch.nn.Parameter(placeholder, requires_grad=param.requires_grad)
        shard._zoe_pager = self
        self._records[id(shard)] = _PagedParam(name, shard, tensor, placeholder, self.tier)
        self.shard_bytes += tensor.nbytes
        return shard

    def _install_hooks(self):
        self._handles.append(self.model.register_forward_pre_hook(self._root_pre_hook))
        self._handles.append(self.model.register_forward_hook(self._root_post_hook))
        self._root_entries = self._direct_entries(self.model)
        self._install_module_hooks(self._direct_entries)
        self._install_state_dict_checks()
        for entry in self._params:
            if entry.param.requires_grad:
                handle, node = on_gradient_accumulated(
                    entry.param, self._reduce_hook(entry)
                )
                self._handles.append(handle)
                self._accumulator_nodes.append(node)
        self._watch_reads()

    def _direct_entries(self, module):
        return [
            self._by_param[id(p)]
            for p in module.parameters(recurse=False)
            if id(p) in self._by_param
        ]

    # --- gathering -------------------------------------------------------------------------

    def _issue_gather(self, entry):
        """Starts gathering ``entry``'s shards (as bytes, each into its place in the full
        parameter: _collective_ops.gather_parts) and the Agreement that every rank could read
        its own and gathers this parameter (its index); returns it pending. A rank that cannot
        read its shard still makes both collectives (its part unset), so every rank fails
        together when it is waited for (_wait_gather)."""
        gathered = torch.empty(entry.bytes, dtype=torch.uint8, device=entry.param.device)
        parts = list(gathered.split([count * entry.element_size for count in entry.counts]))
        error = None
        if entry.shard is not None:
            try:
                with self.held(entry.shard) as values:
                    parts[self.rank].copy_(values.view(-1).view(torch.uint8))
            except Exception as caught:  # agreed with the gather: every rank raises
                error = caught
        with self._collective(f"gather of parameter {entry.name!r}", "gather_seconds"):
            handle = gather_parts(parts, self.group, async_op=True)
            agreement = Agreement(error is not None, self.group, async_op=True,
                                  token=entry.index)
        self._count(in_flight=entry.bytes)
        return _PendingGather(handle, gathered, agreement, error)

    @contextlib.contextmanager
    def _collective(self, what, phase_seconds=None):
        """Runs collectives of ``what``, timed in collective_seconds and ``phase_seconds`` (a
        counter's name, or None); the transport's failure raised as zoe.Aborted naming ``what``
        (_collective_ops.transport_failure_aborted)."""
        with _timed(self, "collective_seconds"), transport_failure_aborted(what):
            if phase_seconds is None:
                yield
            else:
                with _timed(self, phase_seconds):
                    yield

    def _count(self, gathered=0, in_flight=0):
        self.gathered_bytes += gathered
        self.in_flight_bytes += in_flight
        now = self.gathered_bytes + self.in_flight_bytes
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, now)

    def _finish_gather(self, entry, pending):
        """Waits for ``pending`` and makes ``entry``'s full values (shards side by side)."""
        self._wait_gather(entry, pending)
        self._count(gathered=entry.bytes)
        return pending.gathered.view(entry.dtype).view(entry.shape)

    def _wait_gather(self, entry, pending):
        """Waits for a gather and its agreement. Every rank raises together when a rank could
        not read its shard (_collective_ops.agreement_error: that rank its own error, the others
        zoe.Aborted, naming it and the parameter) or when the ranks gathered different
        parameters (_check_same_parameter); first every rank waits for the gathers it issued
        ahead, the same on every rank up to here, and drops them, so that the ranks' next
        gathers pair again."""
        try:
            with self._collective(f"gather of parameter {entry.name!r}", "gather_seconds"):
                pending.handle.wait()
                failed = pending.agreement.failed_ranks()
        finally:
            self._count(in_flight=-entry.bytes)
        tokens = pending.agreement.tokens()
        if failed or len(set(tokens)) > 1:
            self._drain_prefetches()
        if failed:
            raise agreement_error(f"gathering parameter {entry.name!r}", pending.error, failed,
                                  self.group) from pending.error
        self._check_same_parameter(tokens)

    def _check_same_parameter(self, gathered):
        """InvalidArgument on every rank when the ranks gathered different parameters
        (``gathered``: each rank's parameter index): their shards were paired with the wrong
        ones (same sizes) and the values are wrong, so nothing may use them."""
        if len(set(gathered)) == 1:
            return
        each = "; ".join(f"rank {rank}: {self._params[index].name!r}"
                         for rank, index in enumerate(gathered))
        raise _invalid(
            f"the ranks gathered different parameters at once ({each}): at ZeRO stage 3 every "
            "rank must run the same modules in the same order (a module run on some ranks "
            "only, such as an expert no token of a rank was routed to, pairs its gathers with "
            "other parameters' on the other ranks); run every module on every rank (an unused "
            "output times 0), or use stage 1, which gathers nothing")

    def _gather(self, entry):
        """Makes ``entry`` gathered: its prefetched all-gather, or one issued now."""
        pending = self._pending.pop(entry, None)
        self.gathers["prefetched" if pending else "on_demand"] += 1
        if pending is None:
            pending = self._issue_gather(entry)
        entry.full = self._finish_gather(entry, pending)
        entry.param.data = entry.full
        self._full_by_address[_storage_pointer(entry.full)] = entry
        try:
            self._advance_trace(entry)
        except BaseException:  # a prefetch refused (the ranks diverged): nothing holds it yet
            self._free(entry)
            raise

    def _free(self, entry):
        self._full_by_address.pop(_storage_pointer(entry.full), None)
        self._count(gathered=-entry.full.numel() * entry.element_size)
        entry.full = None
        entry.param.data = entry.placeholder

    def _hold_full(self, entry, backward=False):
        if entry.full is None:
            self._gather(entry)
        elif entry.holds + entry.backward_holds == 1 and entry in self._keep:
            self.gathers["kept"] += 1  # held by the keep alone: freed without it
        if backward:
            entry.backward_holds += 1
        else:
            entry.holds += 1
        return entry.full

    def _unhold_full(self, entry, backward=False):
        if backward:
            entry.backward_holds -= 1
        else:
            entry.holds -= 1
        if entry.holds + entry.backward_holds == 0:
            self._free(entry)

    def _item_of(self, param):
        return self._by_param.get(id(param))

    def _hold_for_forward(self, entry):
        self._hold_full(entry)

    def _release_after_forward(self, entry):
        """A module's forward is done with ``entry``: kept gathered for backward (its hold
        passes to the keep, stage3_keep) when autograd saved its values and the policy allows,
        else unheld; the parameters the keep lets go are unheld. In a forward recomputed in
        backward its hold passes to backward (_hold_for_backward_if_recomputing)."""
        if self._hold_for_backward_if_recomputing(entry):
            return
        elements = sum(entry.counts)
        if not (self._in_iteration and entry.saved and self._keep.enabled
                and torch.is_grad_enabled()):
            for old in self._keep.finished(elements):  # it counts in the distances all the same
                self._unhold_full(old)
            self._unhold_full(entry)
            return
        kept_already = entry in self._keep
        released = self._keep.keep(entry, elements)
        if kept_already:  # the keep holds it once
            self._unhold_full(entry)
        for old in released:
            self._unhold_full(old)

    def _release_kept(self, entry):
        """Backward is done with ``entry``: its keep's hold, if kept, is released."""
        if self._keep.release(entry):
            self._unhold_full(entry)

    # --- the trace -------------------------------------------------------------------------

    def _advance_trace(self, entry):
        """Records a gather; with a recorded trace, moves its cursor past ``entry`` and issues
        the next ``prefetch_depth`` gathers of the trace that are neither gathered nor in
        flight. Every rank sees the same gathers, so every rank issues the same ones. Gathers
        outside an iteration (state_dict, remove) are neither recorded nor followed."""
        if not self._in_iteration:
            return
        self._events.append(entry.index)
        if self._trace is None:
            return
        try:
            self._cursor = self._trace.index(entry.index, self._cursor) + 1
        except ValueError:
            return  # not where the trace says: no look-ahead until it matches again
        for index in self._trace[self._cursor : self._cursor + self.prefetch_depth]:
            ahead = self._params[index]
            if ahead.full is None and ahead not in self._pending:
                self._pending[ahead] = self._issue_gather(ahead)

    def _drain_prefetches(self):
        """Waits for gathers issued ahead that the iteration did not use, and drops them: every
        one, then raises the first that failed (every rank fails alike: each gather is agreed)."""
        pending, self._pending = self._pending, {}
        failure = None
        for entry, gather in pending.items():
            try:
                self._wait_gather(entry, gather)
            except Exception as error:  # raised once every gather is waited for
                failure = failure or error
        if failure is not None:
            raise failure

    # --- backward --------------------------------------------------------------------------

    def _pack(self, tensor):
        entry = self._full_by_address.get(_storage_pointer(tensor)) if tensor.numel() else None
        if entry is None:
            return tensor
        entry.saved = True
        return (entry, tensor.dtype, tensor.size(), tensor.stride(), tensor.storage_offset())

    def _unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        entry, dtype, size, stride, offset = packed
        flat = self._hold_full(entry, backward=True).view(-1)
        if dtype != flat.dtype:
            flat = flat.view(dtype)
        return flat.as_strided(size, stride, offset)

    def _reduce_hook(self, entry):
        def hook():
            self._queue_backward_end()
            self._reduce_grad(entry)
            while entry.backward_holds:
                self._unhold_full(entry, backward=True)
            self._release_kept(entry)
        return hook

    def _reduce_grad(self, entry):
        """Moves the full gradient out of param.grad (flat and fp32: a contiguous fp32
        gradient itself, which autograd gave param.grad alone, else a copy). A gradient of
        ``bucket_elements`` elements or more is reduced alone at once, from its own memory;
        a smaller one joins the pending bucket, reduced once it holds ``bucket_elements``
        elements or more (its gradients copied side by side: worth it only for small ones)."""
        grad, entry.param.grad = entry.param.grad, None
        if grad is None:
            return
        total = grad.detach().reshape(-1)
        if total.dtype != torch.float32 or grad.requires_grad:  # create_graph: autograd's
            total = total.to(torch.float32, copy=True)
        del grad  # the full gradient is not held twice while buckets are reduced
        if total.numel() >= self.bucket_elements:
            self._start_reduction([(entry, total)])
            return
        if self._bucket and self._bucket[0][1].device != total.device:
            self._reduce_bucket()  # a bucket's buffer lives on one device
        self._bucket.append((entry, total))
        self._bucket_size += total.numel()
        if self._bucket_size >= self.bucket_elements:
            self._reduce_bucket()

    def _reduce_bucket(self):
        """Starts reducing the pending bucket (_start_reduction), which is then empty."""
        gradients, self._bucket, self._bucket_size = self._bucket, [], 0
        if gradients:
            self._start_reduction(gradients)

    def _start_reduction(self, gradients):
        """Starts summing ``gradients`` ((entry, flat fp32 gradient) pairs) over the ranks as
        one bucket, each rank's part onto that rank (one _collective_ops.reduce_parts); at most
        distributed.REDUCTIONS_IN_FLIGHT buckets run while backward goes on, the oldest finished
        first."""
        bucket = _GradientBucket(gradients, self.world_size)
        gradients.clear()  # a bucket of several holds only its rank-major copy from here
        with self._collective(bucket.reduction(), "reduction_seconds"):
            bucket.handle = reduce_parts(bucket.parts, self.group, async_op=True)
        self.reductions["issued"] += 1
        self.reductions["parameters"] += len(bucket.entries)
        self._reductions.add(bucket, self._finish_reduction)

    def _finish_reductions(self):
        """Reduces the partly filled bucket and finishes every bucket in flight."""
        self._reduce_bucket()
        self._reductions.finish_all(self._finish_reduction)

    def _finish_reduction(self, bucket):
        """Waits for a bucket's sum and hands each parameter's slice of this rank's part, / N, to
        its shard's gradient sink, or adds it to the shard's .grad."""
        with self._collective(bucket.reduction(), "reduction_seconds"):
            bucket.handle.wait()
        mine, offset = bucket.parts[self.rank], 0
        for entry in bucket.entries:
            if entry.shard is not None:
                grad = mine[offset : offset + entry.count].div_(self.world_size).to(entry.dtype)
                sink = self._gradient_sinks.get(id(entry.shard))
                if sink is not None:
                    sink(entry.shard, grad)
                elif entry.shard.grad is None:
                    entry.shard.grad = grad.clone()
                else:
                    entry.shard.grad.add_(grad)
            offset += entry.count

    # --- iterations ------------------------------------------------------------------------

    def _root_pre_hook(self, module, inputs):
        super()._root_pre_hook(module, inputs)
        self._events = []
        self._cursor = 0
        for entry in self._root_entries:
            self._hold_full(entry)
            self._frames.add(entry)

    def _end_iteration(self):
        if not self._in_iteration:
            return
        self._frames.end_all(self._release_after_forward)  # left by a recomputation stopped early
        for entry in self._keep.release_all():
            self._unhold_full(entry)
        for entry in self._params:
            entry.saved = False
            while entry.backward_holds:
                self._unhold_full(entry, backward=True)
        self._drain_prefetches()
        self._finish_reductions()
        if self._trace != self._events:
            self.gathers["rerecorded"] += self._trace is not None
            self._trace = list(self._events)
        super()._end_iteration()

    # --- what users call -------------------------------------------------------------------

    def shard_parameters(self):
        """This rank's non-empty shards, as leaf tensors in the model's parameter order: what
        the stage 3 optimizer steps (their .grad holds the mean gradient after backward)."""
        return [entry.shard for entry in self._params if entry.shard is not None]

    def shard_of(self, param):
        """This rank's shard of one of the model's parameters (None when the shard is empty);
        KeyError for a parameter this pager does not shard."""
        return self._by_param[id(param)].shard

    def named_shard_parameters(self):
        """(parameter name, shard) for this rank's non-empty shards."""
        return [(entry.name, entry.shard) for entry in self._params if entry.shard is not None]

    def set_gradient_sink(self, shard, sink):
        """Routes the shard's reduced gradient to ``sink(shard, grad)`` instead of its .grad
        (a zoe optimizer streaming it: grad_stream.py); None routes it to .grad again."""
        if sink is None:
            self._gradient_sinks.pop(id(shard), None)
        else:
            self._gradient_sinks[id(shard)] = sink

    def all_reduce_sum(self, values, what):
        """Sums ``values`` (a CPU tensor) over the ranks in place, once the gradient reductions
        in flight are finished (every rank calls it); zoe.Aborted naming ``what`` when the
        collective fails."""
        self._finish_reductions()
        with self._collective(f"all_reduce of {what}"):
            dist.all_reduce(values, group=self.group)

    def _check_no_sinks(self, what):
        """InvalidArgument for ``what`` (on .grad) when a zoe optimizer streams the gradients."""
        if self._gradient_sinks:
            raise _invalid(
                f"{what}: a zoe optimizer streams these shards' gradients (their .grad stays "
                "None); give the optimizer max_grad_norm (or the engine gradient_clipping) and "
                "it clips by the global norm over every rank's shards, and skips a step with an "
                "inf/NaN gradient on every rank")

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm=None, norm_type=2.0):
        """The global 2-norm of the gradients over every rank's shards (one all-reduce of the
        squared norms), and with ``max_norm`` every shard gradient scaled by
        max_norm / (norm + 1e-6) when that is below 1, as torch.nn.utils.clip_grad_norm_. Every
        rank gets the same norm: inf or NaN on all ranks when any gradient is not finite, so
        ``if not math.isfinite(norm)`` skips the step on every rank together."""
        self._check_no_sinks("pager.clip_grad_norm_")
        if float(norm_type) != 2.0:
            raise _invalid(f"norm_type = {norm_type!r} is not supported; allowed: 2.0")
        self._finish_reductions()
        squares = torch.zeros(1, dtype=torch.float64)
        grads = [s.grad for s in self.shard_parameters() if s.grad is not None]
        for grad in grads:
            squares += grad.double().pow(2).sum()
        with self._collective("all_reduce of the gradient norm"):
            dist.all_reduce(squares, group=self.group)
        norm = math.sqrt(squares.item()) if squares.item() >= 0 else float("nan")
        if max_norm is not None and math.isfinite(norm):
            coefficient = float(max_norm) / (norm + 1e-6)
            if coefficient < 1.0:
                for grad in grads:
                    grad.mul_(coefficient)
        return norm

    @torch.no_grad()
    def any_gradient_nonfinite(self):
        """Whether some rank's shard gradients hold an inf or NaN (one all-reduce of one flag):
        the same answer on every rank, so that a stage 3 optimizer skips a step on every rank
        together. Every rank calls it."""
        self._finish_reductions()
        local = any(not _all_finite(s.grad) for s in self.shard_parameters()
                    if s.grad is not None)
        flag = torch.tensor([1.0 if local else 0.0], dtype=torch.float64)
        with self._collective("all_reduce of the inf/NaN check"):
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return flag.item() > 0

    # --- materialized ----------------------------------------------------------------------

    @contextlib.contextmanager
    def materialized(self, access=_capi.Access.READ_WRITE):
        """Every parameter gathered in full for the block, ``param.data`` its full values, and
        this rank's shards acquired (``access``) as the one-process pager's: a collective, every
        rank enters and leaves it together (a rank that does not waits at the first gather until
        the process group's timeout, then raises zoe.Aborted). The whole model is held at once.

        READ: values read inside are the full ones; writes are dropped at exit. READ_WRITE (the
        default) or WRITE: at exit each rank keeps the writes that landed in its own shard:
        written through the full parameter (``param.copy_``, ``model.load_state_dict``, a torch
        optimizer over ``model.parameters()``), this rank's slice of it is written to its shard,
        and a write to another rank's slice is that rank's to keep (write the same values on
        every rank); written through the shard (a torch optimizer over ``shard_parameters()``),
        it stays. With writes, leaving is agreed (all-reduces): when the block raised on any
        rank, or wrote a shard both ways on any rank (FailedPrecondition there), no rank keeps
        anything the block wrote (its shards are restored) and every rank raises (a rank whose
        block raised its own exception, the others zoe.Aborted naming it); a write-back failing
        on a rank raises on every rank too. Whatever happens, every gathered parameter is freed
        and the shards released. ``model.state_dict()`` inside the block holds the full
        values."""
        writes = _capi.Access(access) != _capi.Access.READ
        held = []
        try:
            self._materialize(held, access)
            with self._full_values_held():
                try:
                    yield self.model
                except Exception as error:
                    if writes:
                        self._agree_on_block(held, error)
                    raise
                if writes:
                    self._agree_on_block(held, None)
                    agreed("writing back the parameters written inside pager.materialized()",
                           lambda: self._write_back(held), self.group)
        finally:
            for entry, _ in reversed(held):
                if entry.shard is not None:
                    self._unhold(self._records[id(entry.shard)])
                self._unhold_full(entry)

    def _materialize(self, held, access):
        """Gathers every parameter (all issued first, then waited for in order), then acquires
        this rank's shards (agreed: a rank that cannot makes every rank raise); appends (entry,
        the original values of this rank's slice, or None when nothing is written back) to
        ``held`` as it goes."""
        for entry in self._params:
            if entry.full is None and entry not in self._pending:
                self._pending[entry] = self._issue_gather(entry)
        gathered = []
        try:
            for entry in self._params:
                self._hold_full(entry)
                gathered.append(entry)
        except Exception:
            for entry in gathered:
                self._unhold_full(entry)
            with contextlib.suppress(Exception):  # the gathers every rank issued with it
                self._drain_prefetches()
            raise
        writes = _capi.Access(access) != _capi.Access.READ
        try:
            agreed("acquiring this rank's shards for pager.materialized()",
                   lambda: self._acquire_shards(gathered, held, access, writes), self.group)
        except BaseException:
            for entry in gathered[len(held):]:
                self._unhold_full(entry)
            raise

    def _acquire_shards(self, gathered, held, access, writes):
        """Acquires the shard of each gathered entry, appending it to ``held`` with its slice's
        original values when ``writes``; an acquire that raises leaves the rest unheld."""
        for entry in gathered:
            original = None
            if entry.shard is not None:
                record = self._records[id(entry.shard)]
                self._hold(record, access)
                try:
                    original = self._own_slice(entry).clone() if writes else None
                except BaseException:
                    self._unhold(record)
                    raise
            held.append((entry, original))

    def _own_slice(self, entry):
        """This rank's slice of ``entry``'s gathered full values (a view)."""
        return entry.full.reshape(-1)[entry.begin : entry.begin + entry.count]

    def _agree_on_block(self, held, error):
        """Whether the block raised, or wrote a shard both ways, on some rank (one all-reduce,
        and one more for the check): when it did, every rank drops what the block wrote into
        its shards and raises, a rank whose block raised ``error`` itself."""
        with transport_failure_aborted("the agreement on the block inside pager.materialized()"):
            failed = Agreement(error is not None, self.group).failed_ranks()
        try:
            if failed:
                agreed_error = agreement_error("the block inside pager.materialized()", error,
                                               failed, self.group)
                raise error if error is not None else agreed_error
            agreed("checking the writes inside pager.materialized()",
                   lambda: self._check_writes(held), self.group)
        except Exception:
            for entry, original in held:
                if original is not None:
                    self._records[id(entry.shard)].view.copy_(original)
            raise

    def _check_writes(self, held):
        """FailedPrecondition for a shard written both through its full parameter and through
        the shard itself inside the block."""
        for entry, original in held:
            if original is None or _same_bits(self._own_slice(entry), original):
                continue
            if not _same_bits(self._records[id(entry.shard)].view, original):
                raise FailedPrecondition(
                    _capi.Status.FAILED_PRECONDITION,
                    f"parameter {entry.name!r} was written inside pager.materialized() both "
                    "through the full parameter and through this rank's shard "
                    "(pager.shard_parameters()); write it one way only")

    def _write_back(self, held):
        """Writes this rank's slice of each full parameter written inside the block to its
        shard (a shard written through itself holds its new values already)."""
        for entry, original in held:
            if original is not None and not _same_bits(self._own_slice(entry), original):
                self._records[id(entry.shard)].view.copy_(self._own_slice(entry))

    @contextlib.contextmanager
    def shards_materialized(self, access=_capi.Access.READ_WRITE):
        """This rank's shards acquired for the block, as the one-process pager's materialized()
        acquires its parameters; yields ``shard_parameters()``. No collective and 1/N of the
        model: for a torch optimizer stepping the shards, or reading them."""
        with ParameterPager.materialized(self, access):
            yield self.shard_parameters()

    def stats(self):
        """ParameterPager.stats() plus the gathers (prefetched by the trace, on demand, traces
        re-recorded, and ``kept``: uses that found a parameter kept for backward, each a gather
        saved), the limits of that keeping (``keep``), the gradient reductions (``issued``: buckets
        reduced, one reduce_parts each; ``parameters``: the gradients they held), this rank's shard
        bytes, the peak bytes of gathered parameters and ``collective_seconds``: the wall time this
        rank was blocked issuing or waiting for its gathers and reductions (collectives running in
        the background while it computes are not counted), of which ``gather_seconds`` on gathers
        and ``reduction_seconds`` on gradient reductions (the rest: clipping's and the inf/NaN
        check's all-reduces)."""
        stats = super().stats()
        stats.update(
            gathers=dict(self.gathers),
            keep={"max_live_parameters": self._keep.max_live_parameters,
                  "max_reuse_distance": self._keep.max_reuse_distance},
            reductions=dict(self.reductions),
            shard_bytes=self.shard_bytes,
            peak_gathered_bytes=self.peak_gathered_bytes,
            peak_held_bytes=self.shard_bytes + self.peak_gathered_bytes,
            collective_seconds=self.collective_seconds,
            gather_seconds=self.gather_seconds,
            reduction_seconds=self.reduction_seconds,
        )
        return stats

    def state_dict(self):
        """model.state_dict() with every parameter's full values, gathered one at a time
        (a collective: every rank calls it)."""
        with self._full_values_held():
            state = self.model.state_dict()
        for module_name, module in self.model.named_modules():
            for name, param in module._parameters.items():
                key = f"{module_name}.{name}" if module_name else name
                if param is not None and id(param) in self._by_param and key in state:
                    entry = self._by_param[id(param)]
                    state[key] = self._hold_full(entry).clone()
                    self._unhold_full(entry)
        return state

    # --- checkpoints -------------------------------------------------------------------------

    def _tied_names(self):
        """{name: the name the layout gives} for every other name of a paged parameter (a
        weight tied to another module's), as model.state_dict() lists them."""
        tied = {}
        for module_name, module in self.model.named_modules(remove_duplicate=False):
            for name, param in module._parameters.items():
                key = f"{module_name}.{name}" if module_name else name
                entry = self._by_param.get(id(param)) if param is not None else None
                if entry is not None and key != entry.name:
                    tied[key] = entry.name
        return tied

    def _checkpoint_layout(self):
        """Every parameter's name, shape, dtype and per-rank shard sizes."""
        return [{"name": entry.name, "shape": list(entry.shape),
                 "dtype": str(entry.dtype).replace("torch.", ""), "counts": list(entry.counts)}
                for entry in self._params]

    def _local_group_members(self, optimizer):
        """Per param group of ``optimizer``, the layout indices of the shards it holds on this
        rank, in the group's order; InvalidArgument for a parameter that is not this pager's
        shard."""
        index_of = {id(entry.shard): entry.index for entry in self._params
                    if entry.shard is not None}
        members = []
        for number, group in enumerate(optimizer.param_groups):
            if any(id(param) not in index_of for param in group["params"]):
                raise _invalid(f"param group {number} of the optimizer holds a tensor that is "
                               "not a shard of this pager (pager.shard_parameters()); a stage 3 "
                               "checkpoint saves an optimizer over the pager's shards")
            members.append([index_of[id(param)] for param in group["params"]])
        return members

    def group_members(self, optimizer):
        """Per param group of ``optimizer``, the layout indices (_checkpoint_layout) of the
        parameters whose shards it holds, in the group's order, over every rank (a collective:
        every rank calls it). A rank holds no shard of a parameter smaller than the world size;
        the last rank holds one of every parameter (its shard is never empty), so its lists are
        the groups' whole."""
        comm = TorchCollectives(self.group)
        mine = comm.agreed("listing the parameters of the optimizer's param groups",
                           lambda: self._local_group_members(optimizer))
        every = gather_objects(mine, self.group, "the optimizer's param groups")
        if any(len(members) != len(mine) for members in every):
            raise _invalid(f"the ranks' optimizers have {[len(m) for m in every]} param groups; "
                           "every rank's optimizer must have the same groups")
        return every[-1]

    def _frozen_entries(self, members):
        """(layout index, name, shard) of this rank's non-empty shards of the parameters no
        param group holds (``members``: group_members), in the layout's order."""
        held = {index for group in members for index in group}
        return [(entry.index, entry.name, entry.shard) for entry in self._params
                if entry.index not in held and entry.shard is not None]

    def save_checkpoint(self, directory, optimizer):
        """Saves this rank's parameter shards: ``optimizer`` (a zoe.torch optimizer over
        ``shard_parameters()`` or some of them, in one or several param groups) saves the
        shards it steps with their master weights, moments and step counts (the engine's
        streamed, crash-safe checkpoint) to ``directory``/rank-<r>/save-<n>, the values of the
        shards no param group holds (frozen parameters: frozen_values.py) beside them, and
        rank 0 a manifest naming every rank's save, the parameters' layout, each param group's
        settings and parameters (``group_parameters``: their layout indices, in the group's
        order) and the others (``frozen_parameters``); a save killed on any rank leaves the
        previous checkpoint the one every rank loads (see checkpoint.save_sharded). Every rank
        calls it."""
        members = self.group_members(optimizer)
        frozen = self._frozen_entries(members)
        held = {index for group in members for index in group}
        manifest = {
            "zero_stage": 3,
            "groups": [],
            "parameters": self._checkpoint_layout(),
            "tied": self._tied_names(),
            "param_groups": [{key: value for key, value in group.items() if key != "params"}
                             for group in optimizer.param_groups],
            "group_parameters": members,
            "frozen_parameters": [entry.index for entry in self._params
                                  if entry.index not in held],
            "optimizer": optimizer.kind.name,
        }
        save_sharded(directory, TorchCollectives(self.group),
                     lambda path: save_with_frozen(path, optimizer, self, frozen), manifest)

    def load_checkpoint(self, directory, optimizer):
        """Loads what save_checkpoint wrote on the same world size and parameters, into an
        optimizer whose param groups hold the same parameters in the same order (a checkpoint
        written before the manifest listed them: one group): ``optimizer`` loads this rank's
        save that the manifest names, which sets every shard it steps to its saved master
        weights and each group's settings to the saved ones, and the shards no group holds
        take their saved values. Every rank calls it. Each step is agreed: a failure on one
        rank raises on every rank, naming it, and leaves every rank's optimizer and shards as
        they were (checkpoint.load_shard: the load needs room for one more save of the shard
        beside it)."""
        comm = TorchCollectives(self.group)
        where = f"the stage 3 checkpoint in {directory!r}"
        members = self.group_members(optimizer)
        frozen = self._frozen_entries(members)
        shard_dir = comm.agreed(f"reading the manifest of {where}",
                                lambda: self._shard_to_load(directory, optimizer, members))
        load_shard(comm, f"loading the shards of {where}", shard_dir,
                   lambda path: save_with_frozen(path, optimizer, self, frozen),
                   lambda path: load_with_frozen(path, optimizer, self, frozen, repr(path)))

    def _shard_to_load(self, directory, optimizer, members):
        """This rank's shard that the manifest in ``directory`` names; FailedPrecondition when
        it is not a stage 3 checkpoint of this world size and these parameters, InvalidArgument
        when ``optimizer`` cannot take its param groups (their parameters, ``members`` as
        group_members lists them, or their settings: ZoeOptimizer.check_loadable)."""
        manifest = read_manifest(directory)
        layout = self._checkpoint_layout()
        if (manifest.get("zero_stage") != 3 or manifest["world_size"] != self.world_size
                or manifest.get("parameters") != layout):
            raise FailedPrecondition(
                _capi.Status.FAILED_PRECONDITION,
                f"the checkpoint in {directory!r} is of stage {manifest.get('zero_stage')} on "
                f"{manifest['world_size']} ranks with {len(manifest.get('parameters', []))} "
                f"sharded parameters; this pager is stage 3 on {self.world_size} ranks with "
                f"{len(layout)}: allowed: a stage 3 checkpoint of the same world size and "
                "parameters (names, shapes, dtypes)"
            )
        self._check_frozen(manifest, members, directory)
        self._check_group_members(manifest, members, directory)
        optimizer.check_loadable(manifest.get("param_groups", []),
                                 f"the checkpoint in {directory!r}", manifest.get("optimizer"),
                                 created_now=True)
        return shard_directory(directory, manifest, self.rank)

    def _check_frozen(self, manifest, members, directory):
        """FailedPrecondition when the manifest's parameters that no param group holds are not
        those of ``members``; a manifest written before it kept them (its optimizer held every
        parameter, the frozen ones in its last group) is refused naming what loads it."""
        held = {index for group in members for index in group}
        frozen = [entry.index for entry in self._params if entry.index not in held]
        saved = manifest.get("frozen_parameters")
        if saved is None and frozen:
            raise FailedPrecondition(
                _capi.Status.FAILED_PRECONDITION,
                f"the checkpoint in {directory!r} was saved by a zoe whose stage 3 optimizer "
                "held the frozen parameters (those no param group holds) with the trainable "
                "ones, and this optimizer holds only the trainable ones: load it with "
                "load_optimizer_states=False (engine.load_checkpoint: the module's saved values, "
                "frozen ones too, and a fresh optimizer state), or into an optimizer over every "
                "shard (pager.shard_parameters())")
        if saved is not None and saved != frozen:
            names = [[self._params[index].name for index in indices] for indices in (saved, frozen)]
            raise FailedPrecondition(
                _capi.Status.FAILED_PRECONDITION,
                f"the checkpoint in {directory!r} holds the frozen parameters {names[0]} (those "
                f"no param group holds); this model's are {names[1]}: freeze the same "
                "parameters (requires_grad=False) as when it was saved")

    def _check_group_members(self, manifest, members, directory):
        """InvalidArgument, naming the first difference, when the manifest's param groups hold
        other parameters than ``members`` (a manifest that does not list them: one group)."""
        saved = manifest.get("group_parameters")
        if saved is None and len(manifest.get("param_groups", [])) == 1 == len(members):
            return
        if saved == members:
            return
        def listed(groups):
            return [[self._params[index].name for index in group] for group in groups]

        held = listed(saved) if saved is not None else "(one group, not listed)"
        raise _invalid(f"the checkpoint in {directory!r} holds "
                       f"{len(manifest.get('param_groups', []))} param groups of the parameters "
                       f"{held}; this optimizer's {len(members)} param groups hold "
                       f"{listed(members)}: build the optimizer over the param groups it was "
                       "saved with (at initialize, the same model_parameters=, or a torch "
                       "optimizer over the same param groups)")

    def remove(self):
        """Removes the hooks and gives every parameter its full values as an ordinary tensor
        (a collective: every rank calls it). When that fails (another rank died: zoe.Aborted)
        the pager is removed all the same, and the error raised names the parameters that keep
        their placeholders."""
        try:
            if self._in_iteration:
                self._end_iteration()
            self._drain_prefetches()
            self._restore_full_values()
        except Exception as error:
            left = [entry.name for entry in self._params
                    if entry.param.data_ptr() == entry.placeholder.data_ptr()]
            raise as_zoe_error(
                error, f"{error}. The model's parameters {left[:NAMES_IN_ERRORS]}"
                f"{' and more' if len(left) > NAMES_IN_ERRORS else ''} ({len(left)} of "
                f"{len(self._params)}) keep their placeholders (NaN): load a checkpoint for their "
                "values") from None
        finally:
            for handle in self._handles:
                handle.remove()
            self._handles = []
            self._unwatch_reads()
            for entry in self._params:
                entry.param.__dict__.pop("_zoe_sharded_pager", None)
            self._params.clear()
            self._by_param.clear()
            self._records.clear()

    @torch.no_grad()
    def _restore_full_values(self):
        """Every parameter's full values gathered into an ordinary tensor of its own."""
        for entry in self._params:
            values = self._hold_full(entry).clone()
            self._unhold_full(entry)
            entry.param.data = values


def _all_finite(tensor):
    """Whether every element of ``tensor`` is finite. A sum that is finite proves it (an inf or
    NaN element makes any sum inf or NaN) at a tenth of isfinite's cost; a sum that is not (an
    inf or NaN, or finite values overflowing) is settled element by element."""
    return bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all())


def _same_bits(first, second):
    """Whether two contiguous tensors of one dtype hold the same bytes (NaNs included)."""
    return torch.equal(first.reshape(-1).view(torch.uint8), second.reshape(-1).view(torch.uint8))


def offload_sharded(model, engine, home, trace_name, prefix, tier, process_group,
                    prefetch_depth=DEFAULT_PREFETCH_DEPTH,
                    bucket_elements=None, keep=None):
    """offload_parameters with a process group (see the module docstring); bucket_elements
    None is DEFAULT_BUCKET_ELEMENTS; ``keep`` (a stage3_keep.KeptForBackward; None keeps
    nothing) chooses the full parameters kept from forward to backward."""
    if bucket_elements is None:
        bucket_elements = DEFAULT_BUCKET_ELEMENTS
    if not dist.is_initialized():
        raise _invalid(
            "process_group needs torch.distributed initialised (init_process_group) first"
        )
    if prefetch_depth < 0:
        raise _invalid(f"prefetch_depth = {prefetch_depth!r} is not allowed; allowed: >= 0")
    bucket_elements = whole_count(bucket_elements, "bucket_elements",
                                  "0 or 1: one parameter per bucket")
    pager = ShardedParameterPager(model, engine, trace_name, home, tier, process_group,
                                  prefetch_depth, bucket_elements, keep)
    with torch.no_grad():  # writing the shards can fail on one rank (its swap space): agreed
        agreed("sharding the model's parameters", lambda: pager._register(prefix),
               process_group)
    pager._install_hooks()
    return pager
