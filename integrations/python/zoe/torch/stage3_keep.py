"""Which full parameters ZeRO stage 3 keeps gathered from their forward to their backward, as
DeepSpeed's ``stage3_max_live_parameters`` and ``stage3_max_reuse_distance`` keep them.

A module's forward gathers its parameters and, when it ends, frees them; a parameter whose values
autograd saved (a Linear's weight) is gathered again when backward needs it. Kept instead, it
costs no second gather: backward reuses the values forward had. The parameters forward finishes
last are the ones backward reaches first, so the policy keeps the most recent ones:

* ``max_live_parameters``: the elements kept at once; keeping one more releases the oldest kept
  first.
* ``max_reuse_distance``: a kept parameter is released once forward has finished more than this
  many elements of parameters after it, kept or not (backward reaches it only after at least as
  many).

Either at 0 keeps nothing (every parameter gathered again in backward: the least memory). The
decisions depend only on the order and sizes of the parameters forward finishes, which every
rank sees alike, so every rank keeps the same parameters and issues the same gathers."""

import collections

from .common import whole_count

# DeepSpeed's defaults (deepspeed/runtime/zero/config.py), which zoe.torch.initialize follows.
DEEPSPEED_MAX_LIVE_PARAMETERS = 1_000_000_000
DEEPSPEED_MAX_REUSE_DISTANCE = 1_000_000_000


def elements_setting(name, value):
    """A keep limit in elements (common.whole_count: ``1e9`` too) as an int; InvalidArgument
    naming ``name`` otherwise."""
    return whole_count(value, name, "elements of parameters; 0 keeps none")


class KeptForBackward:
    """The parameters kept gathered for backward (see the module docstring). Entries are the
    pager's parameters; the pager holds each kept one gathered and unholds what this returns."""

    def __init__(self, max_live_parameters=0, max_reuse_distance=0):
        self.max_live_parameters = elements_setting("max_live_parameters", max_live_parameters)
        self.max_reuse_distance = elements_setting("max_reuse_distance", max_reuse_distance)
        self._kept = collections.OrderedDict()  # entry -> forward elements when it was kept
        self._elements = 0  # elements kept now
        self._finished = 0  # elements of parameters forward finished in this iteration

    @property
    def enabled(self):
        return self.max_live_parameters > 0 and self.max_reuse_distance > 0

    def __contains__(self, entry):
        return entry in self._kept

    def keep(self, entry, elements):
        """Forward has finished with ``entry`` (``elements`` elements): kept, and the entries
        now released returned, oldest first (``entry`` itself among them when it alone exceeds
        a limit). An entry kept already stays kept once, as the newest."""
        self._finished += elements
        if entry in self._kept:
            self._kept.move_to_end(entry)
            self._kept[entry] = (self._finished, elements)
        else:
            self._kept[entry] = (self._finished, elements)
            self._elements += elements
        return self._release_over_limits()

    def finished(self, elements):
        """Forward has finished with a parameter it does not keep (``elements`` elements): it
        counts in the kept ones' distances; the entries now released are returned, oldest
        first."""
        self._finished += elements
        return self._release_over_limits()

    def _release_over_limits(self):
        released = []
        while self._kept and self._over_a_limit():
            oldest, (_, count) = self._kept.popitem(last=False)
            self._elements -= count
            released.append(oldest)
        return released

    def _over_a_limit(self):
        finished_at, _ = next(iter(self._kept.values()))
        return (self._elements > self.max_live_parameters
                or self._finished - finished_at > self.max_reuse_distance)

    def release(self, entry):
        """Backward is done with ``entry``: whether it was kept (then no longer)."""
        kept = self._kept.pop(entry, None)
        if kept is None:
            return False
        self._elements -= kept[1]
        return True

    def release_all(self):
        """The end of an iteration: every entry still kept, oldest first; none kept after."""
        released = list(self._kept)
        self._kept.clear()
        self._elements = 0
        self._finished = 0
        return released
