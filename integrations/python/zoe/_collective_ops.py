"""The two collectives ZeRO needs, built from the ones every torch.distributed backend runs well.

A sharded layout gives rank r one contiguous part of a flat buffer. ZeRO moves such buffers
two ways: every rank's part to every rank (all-gather: the updated parameters) and the sum of
every rank's buffer, each part onto its owner (reduce-scatter: the gradients). torch 1.13's gloo
has no reduce_scatter, and its all_gather is slow on large tensors: 4 Mi fp32 elements per rank
on 2 ranks took 10 to 20 times as long as one broadcast per rank of the same parts, and an
all_reduce of the whole buffer moves twice what the owners need (``bench/collective_bench.py``
measures all three on the machine it runs on). So:

* ``gather_parts``: one ``broadcast`` per non-empty part, from its owner, straight into the
  part: no padding for uneven parts and no copy out of a staging buffer (``broadcast_pieces``:
  the same for pieces of any roots).
* ``reduce_parts``: one ``reduce`` per non-empty part, onto its owner.

Every rank must pass parts of the same sizes in the same order (the layout is agreed); parts of
no elements are skipped on every rank alike (gloo refuses empty tensors). With ``async_op``
the returned ``Pending`` is waited on later; otherwise the collectives have finished on return.

A protocol between the ranks (a sharded save or load, a stage 3 gather) must not let one rank
fail alone: the others would wait in their next collective for one it never makes, until the
process group's timeout, or pair it with the wrong one. So each step that one rank can fail ends
in an agreement:

* ``Agreement``: one all-reduce of a failure flag per rank, made by every rank whether its step
  failed or not;
* ``agreed(what, step, group)``: runs ``step()`` and agrees; when it failed on any rank, every
  rank raises (``agreement_error``): the failing rank its own error as zoe's, the others
  zoe.Aborted, both naming the failing ranks and ``what`` failed. The ranks stay paired for
  their next collective.

When the transport itself fails a collective (another rank died, failed or did not call it
before the process group's timeout: torch.distributed raises RuntimeError), no agreement can be
made: ``transport_failure_aborted(what)`` turns that error into zoe.Aborted naming ``what`` and
the way out, and every collective zoe calls runs inside one.
"""

import contextlib

import torch
import torch.distributed as dist

from . import _capi
from .errors import Aborted, Error, as_zoe_error


class Pending:
    """The collectives of one gather or reduction in flight; ``wait()`` waits for all of them
    (raising the first failure, after which the rest are not waited for)."""

    def __init__(self, works):
        self._works = works

    def wait(self):
        works, self._works = self._works, []
        for work in works:
            work.wait()


ABORTED_ADVICE = ("another rank failed, died or timed out; the process group cannot be used "
                  "again: restart every rank and load the latest checkpoint")


def collective_aborted(what, error):
    """zoe.Aborted for ``what``, a collective the transport failed with ``error``."""
    return Aborted(_capi.Status.ABORTED, f"{what} failed ({ABORTED_ADVICE}): {error}")


@contextlib.contextmanager
def transport_failure_aborted(what):
    """Runs collectives of ``what``; the transport's failure (RuntimeError, torch 2's
    DistBackendError among them) is raised as collective_aborted's zoe.Aborted."""
    try:
        yield
    except RuntimeError as error:
        raise collective_aborted(what, error) from None


def gather_parts(parts, group, async_op=False):
    """Every rank's part into ``parts`` (``parts[r]`` receives rank r's values; this rank's own
    part must already hold its values and is only read)."""
    return broadcast_pieces(enumerate(parts), group, async_op)


def broadcast_pieces(pieces, group, async_op=False):
    """For each ``(root, tensor)`` of ``pieces``: the root's values into every other rank's
    tensor (one ``broadcast`` each; every rank passes the same roots and sizes in the same
    order)."""
    works = [
        dist.broadcast(tensor, src=_global_rank(group, root), group=group, async_op=True)
        for root, tensor in pieces
        if tensor.numel() > 0
    ]
    return _finish(works, async_op)


def reduce_parts(parts, group, async_op=False):
    """The sum over the ranks of each ``parts[r]``, left in rank r's ``parts[r]``; on every rank
    the parts it does not own hold unspecified values afterwards."""
    works = [
        dist.reduce(part, dst=_global_rank(group, owner), group=group, async_op=True)
        for owner, part in enumerate(parts)
        if part.numel() > 0
    ]
    return _finish(works, async_op)


def _global_rank(group, rank):
    """The global rank of ``group``'s rank ``rank``: broadcast and reduce name their source and
    destination by global rank."""
    if group is None or group is dist.group.WORLD:
        return rank
    return dist.get_global_rank(group, rank)


def _finish(works, async_op):
    pending = Pending(works)
    if not async_op:
        pending.wait()
    return pending


class Agreement:
    """Which ranks of ``group`` failed one step of a protocol, and what each rank took the step
    to be: one all-reduce of a flag (1 where the rank failed) and a ``token`` per rank (an
    integer below 2**24 naming what the rank did, such as the parameter it gathered; on the GPU
    for NCCL). Every rank makes it whether it failed or not. With ``async_op`` it runs in the
    background until failed_ranks()."""

    def __init__(self, failed, group, async_op=False, token=0):
        device = torch.device("cuda" if dist.get_backend(group) == "nccl" else "cpu")
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        self._flags = torch.zeros(2 * world, dtype=torch.float32, device=device)
        self._flags[world + rank] = float(token)
        if failed:
            self._flags[rank] = 1.0
        self._work = dist.all_reduce(self._flags, group=group, async_op=True)
        if not async_op:
            self.failed_ranks()

    def failed_ranks(self):
        """The ranks that failed, in order; waits for the all-reduce (the transport's
        RuntimeError when it fails)."""
        work, self._work = self._work, None
        if work is not None:
            work.wait()
        flags = self._flags.tolist()
        return [rank for rank, flag in enumerate(flags[:len(flags) // 2]) if flag > 0]

    def tokens(self):
        """Each rank's token, in rank order (after failed_ranks())."""
        flags = self._flags.tolist()
        return [int(token) for token in flags[len(flags) // 2:]]


def agreed(what, step, group):
    """``step()``'s result once every rank of ``group`` ran its own ``step`` and all succeeded;
    else every rank raises agreement_error's error. ``step`` must make no collective call (a
    rank that fails would skip it)."""
    try:
        result, error = step(), None
    except Exception as caught:  # agreed below: every rank raises together
        result, error = None, caught
    with transport_failure_aborted(f"the agreement on {what}"):
        failed = Agreement(error is not None, group).failed_ranks()
    if failed:
        raise agreement_error(what, error, failed, group) from error
    return result


def agreement_error(what, error, failed, group):
    """The error this rank raises when ``what`` failed on the ranks ``failed`` (``error``: this
    rank's exception, None where it succeeded). A collective: every rank calls it, and the
    failing ranks' messages are gathered (one all_gather_object), so that every rank's error
    says what failed where. A failing rank gets its own error as zoe's (errors.as_zoe_error:
    an OSError by its errno), the others zoe.Aborted."""
    report = None
    if error is not None:
        report = f"{type(as_zoe_error(error, '')).__name__}: {_describe(error)}"
    reports = gather_objects(report, group, f"the reports of {what}")
    if error is not None:
        rank = dist.get_rank(group)
        return as_zoe_error(error, f"{what} failed on rank {rank}: {_describe(error)}")
    where = "rank" if len(failed) == 1 else "ranks"
    details = "; ".join(f"rank {rank}: zoe.{reports[rank]}" for rank in failed)
    return Aborted(_capi.Status.ABORTED,
                   f"{what} failed on {where} {', '.join(map(str, failed))} ({details})")


def gather_objects(value, group, what):
    """Every rank's ``value`` (picklable), in rank order: one all_gather_object of ``what``,
    which every rank of ``group`` calls."""
    values = [None] * dist.get_world_size(group)
    with transport_failure_aborted(f"gathering {what}"):
        dist.all_gather_object(values, value, group=group)
    return values


def by_rank(values):
    """Each of ``values`` (one per rank, in rank order) with the ranks that gave it:
    "2 on ranks 0, 2; 1 on rank 1"."""
    ranks_of = {}
    for rank, value in enumerate(values):
        ranks_of.setdefault(value if isinstance(value, str) else repr(value), []).append(rank)
    return "; ".join(f"{shown} on rank{'s' if len(ranks) > 1 else ''} "
                     f"{', '.join(map(str, ranks))}" for shown, ranks in ranks_of.items())


def differences(value, group, what):
    """None when ``value`` (picklable, comparable with ==; ``what``) is the same on every rank
    of ``group``; else by_rank's description of the values. A collective: every rank calls it
    and gets the same answer."""
    values = gather_objects(value, group, what)
    return None if all(other == values[0] for other in values) else by_rank(values)


def _describe(error):
    """A zoe.Error's message; any other exception's class and message."""
    return str(error) if isinstance(error, Error) else f"{type(error).__name__}: {error}"
