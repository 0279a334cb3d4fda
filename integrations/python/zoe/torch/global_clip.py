"""Clipping several param groups by the norm of them all.

torch.nn.utils.clip_grad_norm_ over every parameter, and DeepSpeed's ``gradient_clipping``,
scale every gradient by one factor: ``max_norm / (norm + 1e-6)`` (at most 1) where ``norm`` is
the L2 norm of all the gradients together. zoe's step of one group clips by that group's norm,
read in the same pass as its update; an optimizer with several param groups instead adds up
each group's sum of squares first (zoe's scan of the gradients handed to it, or torch's norm of
``.grad``; over the ranks of a sharded optimizer), and steps every group with its loss scale
divided by the common factor. A group's own clipping then does not act: its norm after that
scaling is at most ``max_norm * norm_g / (norm + 1e-6)``, below ``max_norm`` -- but for the fp32
rounding of the factor, which can leave a group holding nearly all of the norm a relative 1e-7
above it, and clipped by that much more.

Gradients that carry a loss scale (the optimizer's grad_scale under fp16) are summed as they
are and the norm divided by it: clipping and the skip act on the unscaled norm, and each
group's zoe step divides its gradients by grad_scale times the clip's loss_scale.

A global norm that is inf or NaN skips the step of every group (each group's gradients
dropped, its state as it was), with or without clipping, as an fp16 overflow does: no group
steps while another skips. Every rank of a sharded optimizer sees the same all-reduced norm and
skips with the others."""

import dataclasses
import math

import torch

from .grad_stream import clip_coefficient


@dataclasses.dataclass(frozen=True)
class GlobalClip:
    norm: float  # L2 norm of every group's unscaled gradients (inf or NaN: skip every group)
    loss_scale: float  # 1 / the clip factor: each group's zoe step divides by it (x grad_scale)

    @property
    def skip(self):
        return not math.isfinite(self.norm)

    @classmethod
    def of(cls, sum_squares, max_norm, grad_scale=1.0):
        """The clip of gradients whose squares add up to ``sum_squares`` and which carry the
        factor ``grad_scale``, to ``max_norm`` (0: none, the factor 1) by their norm divided by
        ``grad_scale``; the factor in fp32, as clip_grad_norm_ computes it."""
        norm = math.sqrt(sum_squares) / grad_scale if sum_squares >= 0.0 else math.nan
        if not math.isfinite(norm):
            return cls(norm=norm, loss_scale=1.0)
        factor = clip_coefficient(torch.tensor(norm, dtype=torch.float32), max_norm)
        return cls(norm=norm, loss_scale=1.0 / factor)

    def unscaled(self, result):
        """A group's StepResult with its own norm before the clip (zoe saw it scaled)."""
        if result.skipped:
            return result
        return dataclasses.replace(result, grad_norm=result.grad_norm * self.loss_scale)


def grads_sum_squares(grads):
    """The sum of squares of ``grads`` (tensors or None), each gradient's norm in fp32 as
    clip_grad_norm_ takes it; inf or NaN when one is not finite."""
    norms = [float(torch.linalg.vector_norm(grad.detach().float()))
             for grad in grads if grad is not None]
    return math.fsum(norm * norm for norm in norms)
