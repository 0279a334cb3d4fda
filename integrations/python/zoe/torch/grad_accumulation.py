"""Where the gradients of a step's micro-batches add up, as a zoe.torch optimizer reads them.

* In ``.grad`` (``dtype`` None, the default): in the parameters' dtype, as torch accumulates.
* In fp32 (``dtype`` torch.float32: DeepSpeed's ``data_types.grad_accum_dtype`` "fp32" for a
  bf16 or fp16 model): when a micro-batch before the step's last ends (the optimizer's
  no_sync() closes), each of the optimizer's ``.grad`` is added into an fp32 sum of its own, on
  the parameter's device, and released; the last micro-batch's is added when the step (or a
  hook of its backward) first reads it. The micro-batches are never rounded to the model's
  dtype in between. The sums take 4 bytes per element of the parameters with a gradient, from
  the first micro-batch to zero_grad(), as DeepSpeed's bf16 optimizer keeps its fp32
  gradients.

Every reader of the optimizer's gradients asks present() and gradient() (the host step, ZeRO's
reductions, the device groups' copies, the engine's stage 0 average); nothing else reads
``.grad`` for a parameter the optimizer steps. Stage 3's gradient stores (grad_stream.py)
accumulate in fp32 of their own."""

import torch

from .common import _invalid


class GradientAccumulation:
    """The micro-batches' gradients of one optimizer's parameters (see the module docstring)."""

    def __init__(self, dtype=None):
        if dtype not in (None, torch.float32):
            raise _invalid(f"grad_accum_dtype = {dtype!r} is not allowed; allowed: None (the "
                           "parameters' dtype, in .grad) or torch.float32")
        self.dtype = dtype
        self._sums = {}  # id(param) -> the fp32 sum of its earlier micro-batches' gradients

    def dtype_of(self, param):
        """The dtype gradient() gives for ``param``."""
        return self.dtype or param.dtype

    def fold(self, params):
        """A micro-batch before the step's last has ended: in fp32, every ``.grad`` of
        ``params`` is added into its sum and released (set to None); else nothing."""
        if self.dtype is None:
            return
        for param in params:
            self._fold(param)

    @torch.no_grad()
    def _fold(self, param):
        grad = param.grad
        if grad is None:
            return
        total = self._sums.get(id(param))
        if total is None:
            self._sums[id(param)] = grad.detach().to(torch.float32, copy=True)
        else:
            total.add_(grad.detach())
        param.grad = None

    def present(self, param):
        """Whether ``param`` has a gradient in this step's micro-batches so far."""
        return param.grad is not None or id(param) in self._sums

    def gradient(self, param):
        """``param``'s gradient over this step's micro-batches so far (None without one): in
        fp32 its sum, into which ``.grad`` is folded first (so the tensor returned holds it
        until zero_grad(), also for a copy still reading it); else ``.grad``."""
        if self.dtype is None:
            return param.grad
        self._fold(param)
        return self._sums.get(id(param))

    @torch.no_grad()
    def assign(self, param, value):
        """Makes ``value`` (a tensor of param's shape, any float dtype; not kept) ``param``'s
        whole gradient: the sum in fp32 (``.grad`` released), else ``.grad`` in its dtype."""
        if self.dtype is None:
            param.grad = value.to(param.dtype, copy=True)
            return
        self._sums[id(param)] = value.to(torch.float32, copy=True)
        param.grad = None

    def clear(self):
        """Drops every sum (zero_grad)."""
        self._sums.clear()
