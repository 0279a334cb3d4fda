"""The two collectives ZeRO needs, built from the ones every torch.distributed backend runs well.

A sharded layout gives rank r one contiguous part of a flat buffer. ZeRO moves such buffers
two ways: every rank's part to every rank (all-gather: the updated parameters) and the sum of
every rank's buffer, each part onto its owner (reduce-scatter: the gradients). torch 1.13's gloo
has no reduce_scatter, and its all_gather is slow on large tensors: 4 Mi fp32 elements per rank
on 2 ranks took 10 to 20 times as long as one broadcast per rank of the same parts, and an
all_reduce of the whole buffer moves twice what the owners need (``bench/collective_bench.py``
measures all three on the machine it runs on). So:

* ``gather_parts``: one ``broadcast`` per non-empty part, from its owner, straight into the
  part: no padding for uneven parts and no copy out of a staging buffer.
* ``reduce_parts``: one ``reduce`` per non-empty part, onto its owner.

Every rank must pass parts of the same sizes in the same order (the layout is agreed); parts of
no elements are skipped on every rank alike (gloo refuses empty tensors). With ``async_op``
the returned ``Pending`` is waited on later; otherwise the collectives have finished on return.
"""

import torch.distributed as dist


class Pending:
    """The collectives of one gather or reduction in flight; ``wait()`` waits for all of them
    (raising the first failure, after which the rest are not waited for)."""

    def __init__(self, works):
        self._works = works

    def wait(self):
        works, self._works = self._works, []
        for work in works:
            work.wait()


def gather_parts(parts, group, async_op=False):
    """Every rank's part into ``parts`` (``parts[r]`` receives rank r's values; this rank's own
    part must already hold its values and is only read)."""
    works = [
        dist.broadcast(part, src=_global_rank(group, owner), group=group, async_op=True)
        for owner, part in enumerate(parts)
        if part.numel() > 0
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
