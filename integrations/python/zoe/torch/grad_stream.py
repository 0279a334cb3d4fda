"""Streamed gradients: the gradients of paged parameters taken out of backward as each becomes
final, so a model's gradients are never held whole.

A zoe optimizer over paged parameters (offload_parameters, zero_init, a ShardedParameterPager's
shards) gives each paged parameter of a param group a gradient store: a zoe tensor of the
parameter's elements in fp32, registered in the pager's engine with the pager's home tier. When
a parameter's gradient is final in a backward (its post-accumulate hook; for a stage 3 shard, its
slice of a reduced bucket), the gradient is added into its store (written on its first backward
since the last step, added on the next ones: accumulation over micro-batches in fp32) and the
gradient's own memory is released: ``param.grad`` stays None. The store is an ordinary zoe tensor:
HOST within the tensors' budget, written to NVMe (checksummed, as every swapped byte) when the
budget needs the room, read back at the step. The stores are a chunk group of their own: a chunk
they shared with parameters acquired on the GPU (the pager's DEVICE tier) could not be written on
the host while those are held there, as they are in backward. Peak gradient memory is thus
bounded by the tensors' HOST budget, not by the model.

Each time a store is written, the norm of its accumulated values is taken (fp32, as
``torch.nn.utils.clip_grad_norm_`` takes each gradient's), so the step knows the global norm,
and whether any gradient is inf/NaN, without reading the gradients again: the norm of the
parameters' norms, as clip_grad_norm_ computes it (over the ranks of a sharded pager, the
square root of the all-reduced sum of the shards' squared norms).

The step (``GradStream.step``) hands zoe's group the gradients window by window: the longest
runs of consecutive parameters whose stores fit a quarter of the tensors' HOST budget are
acquired together and stepped, every other parameter's gradient absent (its state, step count
and values untouched), while the next window's stores are prefetched; zoe writes the window's
updated parameters straight into them (paged ones acquired for writing for the window), or, for
a window of one parameter too large to sit beside its store within the budget, they are written
from the master once the store is released. Clipping is the factor
clip_grad_norm_ applies (``max_norm / (norm + 1e-6)``, at most 1), given to zoe as the step's
loss scale (its reciprocal), so every window is scaled alike. A non-finite norm skips the step
(every rank of a sharded pager together). Gradients are consumed by the step that uses them (as
DeepSpeed's engine.step zeroes them) and dropped by ``optimizer.zero_grad()``."""

import contextlib
import dataclasses
import functools
import math
from typing import Any, Optional

import torch

from .. import _capi
from ..engine import BufferView, StepResult, whole_chunks
from ..errors import FailedPrecondition
from .common import _DTYPES, _in_host_memory, _invalid, _pager_of, _view
from .device import wrap_tier_memory
from .grad_hooks import on_gradient_accumulated

# The share of the tensors' HOST budget one window of gradients may hold (the next window's
# prefetch and the parameters written back take from the rest).
WINDOW_SHARE = 4


@dataclasses.dataclass(eq=False)
class _Store:
    """One paged parameter's gradient store."""

    tensor: Any  # the zoe tensor of numel fp32 elements
    numel: int
    present: bool = False  # holds a gradient since the last step or zero_grad
    norm: Optional[torch.Tensor] = None  # fp32 norm of the accumulated values


def _host_footprint(engine):
    """(bytes of HOST the engine gives registered tensors, a function giving the HOST bytes a
    tensor of n bytes takes there: engine.whole_chunks)."""
    options = engine.config["zoe"]
    return (int(options["tensor_host_budget"]),
            functools.partial(whole_chunks, chunk_bytes=int(options["chunk_size"])))


class GradStream:
    """The streamed gradients of one param group's paged parameters (see the module's
    docstring). ``params``: the group's parameters; ``prefix``: names the stores."""

    def __init__(self, params, prefix):
        self._stores = {}  # id(param) -> _Store
        self._handles = []  # hook handles (and nodes kept alive) to remove at close
        self.pager = None
        self.broken = None  # why a step failed part-way (see step), else None
        self.last_windows = 0  # windows the latest step took
        for index, param in enumerate(params):
            pager = _pager_of(param)
            if pager is None or not param.requires_grad:
                continue  # a frozen parameter gets no gradient (one unfrozen later: in .grad)
            self._check_one_pager(pager)
            tensor = pager.engine.register_tensor(f"{prefix}.grad.{index}", param.numel() * 4,
                                                  _capi.DType.FLOAT32, pager.home,
                                                  group=f"{prefix}.grad")
            self._stores[id(param)] = _Store(tensor, param.numel())
            self._attach(pager, param)

    @staticmethod
    def wanted(params):
        """Whether a param group's gradients stream: any of its parameters is paged."""
        return any(_pager_of(param) is not None for param in params)

    def _check_one_pager(self, pager):
        if self.pager is not None and pager is not self.pager:
            raise _invalid("a param group holds parameters of two pagers; give each pager's "
                           "parameters a param group (or an optimizer) of their own")
        self.pager = pager

    def _attach(self, pager, param):
        """Routes the parameter's final gradient here: a shard's reduced slice through its
        pager's sink, any other parameter's through its post-accumulate hook."""
        set_sink = getattr(pager, "set_gradient_sink", None)
        if set_sink is not None:
            set_sink(param, self.add)
            self._handles.append((None, lambda p=param: set_sink(p, None)))
            return
        handle, node = on_gradient_accumulated(param, lambda p=param: self._take_grad(p))
        self._handles.append((node, handle.remove))

    @property
    def world_size(self):
        return getattr(self.pager, "world_size", 1)

    def close(self):
        """Removes the hooks (the stores stay registered in the engine)."""
        for _, remove in self._handles:
            remove()
        self._handles = []

    # --- backward ----------------------------------------------------------------------------

    def _take_grad(self, param):
        """The post-accumulate hook: the gradient moves into its store; .grad is released."""
        grad = param.grad
        if grad is None:
            return
        param.grad = None
        self.add(param, grad)

    @torch.no_grad()
    def add(self, param, grad):
        """Adds ``grad`` (any float dtype, any device, the parameter's elements) into the
        parameter's store: written when it holds no gradient, else added in fp32."""
        store = self._stores[id(param)]
        if grad.is_sparse:
            raise _invalid("streamed gradients are dense; a sparse gradient reached a paged "
                           "parameter")
        access = _capi.Access.READ_WRITE if store.present else _capi.Access.WRITE
        address = store.tensor.acquire(_capi.Tier.HOST, access)
        try:
            values = wrap_tier_memory(address, store.numel * 4, torch.float32,
                                      torch.device("cpu"))
            flat = grad.detach().reshape(-1)
            if store.present:
                values.add_(flat.to("cpu", torch.float32))
            else:
                values.copy_(flat)
            store.norm = torch.linalg.vector_norm(values)
        finally:
            store.tensor.release()
        store.present = True

    def clear(self):
        """Drops every gradient held (nothing is read or written)."""
        for store in self._stores.values():
            store.present, store.norm = False, None

    # --- the step ----------------------------------------------------------------------------

    def any_present(self, params):
        return any(self._present(param) for param in params)

    def _present(self, param):
        store = self._stores.get(id(param))
        return param.grad is not None if store is None else store.present

    def global_norm(self, params):
        """The norm of every present gradient of ``params`` (streamed or in .grad): the norm of
        the per-parameter fp32 norms, as clip_grad_norm_; over a sharded pager's ranks, the
        square root of the all-reduced sum of squares (every rank calls it). A float; inf or
        NaN when any gradient is."""
        norms = []
        for param in params:
            store = self._stores.get(id(param))
            if store is None:
                if param.grad is not None:  # on the host, beside the stores' norms
                    norms.append(torch.linalg.vector_norm(param.grad.detach().float()).cpu())
            elif store.present:
                norms.append(store.norm)
        local = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())
        if self.world_size <= 1:
            return local
        squares = (local.double() ** 2).reshape(1)
        self.pager.all_reduce_sum(squares, "the streamed gradients' norm")
        return squares.sqrt().float().reshape(())

    def windows(self, params, sizing):
        """[first, end) index ranges of consecutive parameters whose present stores fit a
        window (at least one parameter each), covering every parameter with a gradient.
        ``sizing``: _host_footprint of the pager's engine."""
        budget, footprint = sizing
        budget = max(1, budget // WINDOW_SHARE)
        windows, first, last, held = [], None, None, 0
        for index, param in enumerate(params):
            if not self._present(param):
                continue
            store = self._stores.get(id(param))
            nbytes = 0 if store is None else footprint(store.numel * 4)
            if first is not None and held + nbytes > budget:
                windows.append((first, last + 1))
                first, held = None, 0
            if first is None:
                first = index
            held += nbytes
            last = index
        if first is not None:
            windows.append((first, last + 1))
        return windows

    def prefetch(self, params, window):
        """Starts bringing a window's stores into HOST (never blocks)."""
        if window is None:
            return
        for param in params[window[0]:window[1]]:
            store = self._stores.get(id(param))
            if store is not None and store.present:
                store.tensor.prefetch(_capi.Tier.HOST)

    def _view_for(self, param, inside, held):
        if not inside or not self._present(param):
            return _absent(param)
        store = self._stores.get(id(param))
        if store is None:  # a gradient in .grad (a parameter without a store), in host memory
            grad = param.grad.detach().to("cpu").contiguous()
            held.callback(lambda kept=grad: None)  # alive until zoe has read it
            return _view(grad)
        address = store.tensor.acquire(_capi.Tier.HOST, _capi.Access.READ)
        held.callback(store.tensor.release)
        return BufferView(address, _capi.DType.FLOAT32, store.numel)


    def step(self, params, zoe_group, hyper, loss_scale, write_back):
        """Steps ``zoe_group`` on the present gradients window by window (the next window's
        stores prefetched meanwhile), every window divided by ``loss_scale`` (the reciprocal of
        clip_coefficient()'s factor); returns the StepResult of each window. zoe writes each
        window's updated parameters into them directly (paged ones acquired for writing for the
        window); those it cannot reach (a CUDA tensor) are written by ``write_back(present)``
        afterwards (per parameter: whether to write it). The gradients are consumed. A failure
        once a window was stepped (or whose window's parameters could not be given their values
        back) leaves the group partly stepped: ``broken`` then says so and the optimizer refuses
        to step until a checkpoint is loaded; a failure in the first window leaves everything
        as it was."""
        self.check_usable()
        sizing = _host_footprint(self.pager.engine)
        windows = self.windows(params, sizing)
        self.last_windows = len(windows)
        results, dirty = [], [False]
        try:
            for position, window in enumerate(windows):
                following = windows[position + 1] if position + 1 < len(windows) else None
                self.prefetch(params, following)
                step = functools.partial(zoe_group.step, hyper, loss_scale=loss_scale)
                written = self._params_fit_beside_stores(params, window, sizing)
                results.append(self._step_window(params, window, written, step, write_back,
                                                 dirty))
        except BaseException as error:
            if results or dirty[0]:
                self.broken = (f"its step failed after {len(results)} of {len(windows)} "
                               f"windows of streamed gradients were applied ({error})")
            raise
        if len(results) > 1:
            # zoe counted each window as a step: the group's count becomes its segments' largest
            zoe_group.segment_steps = zoe_group.segment_steps
        self.clear()
        return results

    def _step_window(self, params, window, written, step, write_back, dirty):
        """One window's step(grads=, params_out=): its stores acquired for reading, then (every
        store read, and when ``written``) its parameters for writing, for the call; without
        ``written`` they are written back from the master afterwards. When the call fails, zoe's
        state is as it was, so the window's parameters are written back from its master, which
        holds their values; ``dirty[0]`` stays set when even that fails."""
        first, end = window
        inside = [first <= index < end and self._present(param)
                  for index, param in enumerate(params)]
        try:
            with contextlib.ExitStack() as held:
                grads = [self._view_for(param, within, held)
                         for param, within in zip(params, inside)]
                dirty[0] = True
                outs = [self._output_for(param, held) if within and written else _absent(param)
                        for param, within in zip(params, inside)]
                result = step(grads=grads, params_out=outs)
        except BaseException:
            if dirty[0]:
                write_back(inside)
                dirty[0] = False
            raise
        dirty[0] = False
        later = [within and out.data == 0 for within, out in zip(inside, outs)]
        if any(later):
            write_back(later)
        return result

    def _params_fit_beside_stores(self, params, window, sizing):
        """Whether zoe may write the window's parameters during its step, acquired beside its
        stores: when both fit the tensors' HOST budget together (a window's stores take at most
        a quarter of it, so only a window of one large parameter may not). Otherwise they are
        written from the master afterwards, one at a time once the stores are released, so no
        window needs more HOST than the budget."""
        budget, footprint = sizing
        held = 0
        for param in params[window[0]:window[1]]:
            store = self._stores.get(id(param)) if self._present(param) else None
            if store is not None:
                held += footprint(store.numel * 4) + footprint(param.numel() * param.element_size())
        return held <= budget

    @staticmethod
    def _output_for(param, held):
        """The BufferView zoe writes a parameter's update into: its memory when that is host
        memory (_in_host_memory; a paged one's HOST copy, acquired for writing), else one
        without data (written back afterwards)."""
        if not _in_host_memory(param):
            return _absent(param)
        pager = _pager_of(param)
        if pager is None:
            target = param.detach()
        else:
            target = held.enter_context(pager.held_on_host(param, _capi.Access.WRITE))
        if not target.is_contiguous():
            return _absent(param)
        return _view(target)

    def check_usable(self):
        """FailedPrecondition when an earlier step failed part-way (see step)."""
        if self.broken is not None:
            raise FailedPrecondition(
                _capi.Status.FAILED_PRECONDITION,
                f"the param group's optimizer state is partly stepped: {self.broken}; load a "
                "checkpoint (optimizer.load_checkpoint, or the engine's load_checkpoint) to "
                "resume")


def _absent(param):
    """A BufferView without data covering a parameter's elements."""
    return BufferView(0, _DTYPES[param.dtype], param.numel())


def clip_coefficient(norm, max_norm):
    """clip_grad_norm_'s factor for a global ``norm`` (an fp32 tensor): max_norm / (norm + 1e-6)
    in fp32, at most 1; 1.0 without clipping."""
    if not max_norm:
        return 1.0
    coefficient = max_norm / (norm + 1e-6)
    return float(torch.clamp(coefficient, max=1.0))


def combined_result(results, norm, skipped, steps_taken):
    """One StepResult for a step taken window by window."""
    return StepResult(
        skipped=skipped,
        grad_norm=float(norm),
        steps_taken=steps_taken,
        bytes_read=sum(result.bytes_read for result in results),
        bytes_written=sum(result.bytes_written for result in results),
        seconds=sum(result.seconds for result in results),
    )


def is_finite(norm):
    return math.isfinite(float(norm))
