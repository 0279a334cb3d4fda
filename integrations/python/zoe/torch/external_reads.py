"""Paged parameters read outside the forward of their own module: a tied head written by hand
(``h @ self.emb.weight.t()`` in the parent's forward), a weight shared by reading another
module's attribute. A pager makes a parameter's values present for the forward of the module
that owns it; read anywhere else it is its placeholder. So that such a read gets the values
while a forward runs (as DeepSpeed gathers its "external" parameters), the pager watches the
reads of paged parameters by name (``module.weight`` looks the parameter up in
``module._parameters``, which becomes a ReadWatchedParameters) and keeps ForwardFrames: the
forwards running now, the model's and each of its modules', innermost last. A paged parameter
read while one runs, and not held by it, is acquired (gathered at stage 3) for the innermost one
and released when it ends, as the module's own parameters are released then (kept for backward
when autograd saved them and the keep policy allows, at stage 3). A module's forward recomputed
in backward (activation checkpointing) is such a forward too; a plain function recomputed there
is none. Outside every forward a read still gets the placeholder: the pager's ``materialized()``
is the way to read values there (a collective at stage 3, which a read by one rank's code alone
must not start)."""

import collections
import functools


class ReadWatchedParameters(collections.OrderedDict):
    """A module's ``_parameters`` whose lookups by name (``module.weight``) call
    ``on_read(param)`` before returning the parameter. Iterating it (``named_parameters()``,
    ``state_dict()``) reads nothing through it."""

    def __init__(self, parameters=(), on_read=None):  # no arguments: as a copy is rebuilt
        super().__init__(parameters)
        self.on_read = on_read

    def __getitem__(self, name):
        param = super().__getitem__(name)
        if param is not None and self.on_read is not None:
            self.on_read(param)
        return param


def watch_reads(module, on_read):
    """Makes ``module._parameters`` a ReadWatchedParameters calling ``on_read``; returns the
    type it had, for unwatch_reads."""
    original = type(module._parameters)
    module._parameters = ReadWatchedParameters(module._parameters, on_read)
    return original


def unwatch_reads(module, original):
    """Gives ``module`` back its ``_parameters`` of type ``original``, as watch_reads found it
    (with the parameters it holds now; copied without reading through the watch)."""
    watched = module._parameters
    watched.on_read = None
    module._parameters = original(watched)


class ForwardFrames:
    """The forwards running now, innermost last, each with the items (a pager's paged
    parameters) held for it: its module's own, held by the pager's pre-hook, and those acquired
    because they were read during it. Ending a forward releases all of them; a forward that
    raised (its post-hook never ran, as when torch stops a recomputation early) is ended by the
    next end of a forward around it, or by end_all."""

    def __init__(self):
        self._frames = []  # (owner, ids of the items held for it, the items held for it)

    def running(self):
        return bool(self._frames)

    def begin(self, owner):
        """The forward of ``owner`` (a module) begins, holding nothing yet."""
        self._frames.append((owner, set(), []))

    def holds(self, item):
        """Whether the innermost forward holds ``item`` (one must be running)."""
        return id(item) in self._frames[-1][1]

    def add(self, item):
        """``item`` was held for the innermost forward (one must be running)."""
        _, held, items = self._frames[-1]
        held.add(id(item))
        items.append(item)

    def end(self, owner, release):
        """The forward of ``owner`` ended: ``release(item)`` for each item held for it, and for
        those of the forwards begun inside it that never ended (they raised)."""
        if not any(frame[0] is owner for frame in self._frames):
            return
        while self._end_innermost(release) is not owner:
            pass

    def end_all(self, release):
        """Every forward left running ended, innermost first."""
        while self._frames:
            self._end_innermost(release)

    def _end_innermost(self, release):
        """Ends the innermost forward; returns its owner."""
        owner, _, items = self._frames.pop()
        for item in reversed(items):
            release(item)
        return owner


def end_frames_when_raising(model, on_raise):
    """Wraps ``model.forward`` so that a forward that raises calls ``on_raise()`` before the
    exception leaves it: no forward hook runs then, and the pager must end the frames left
    running (a frame left running would make later reads acquire: at stage 3, start a
    collective on one rank). Returns the wrapper, for stop_ending_frames."""
    inner = model.forward

    @functools.wraps(inner)  # its signature, which Hugging Face's Trainer reads
    def forward(*args, **kwargs):
        try:
            return inner(*args, **kwargs)
        except BaseException:
            on_raise()
            raise

    forward.zoe_inner = inner
    forward.zoe_own = "forward" in model.__dict__  # an instance's own forward, to put back
    model.forward = forward
    return forward


def stop_ending_frames(model, wrapper):
    """Undoes end_frames_when_raising: ``model.forward`` as it was (when the wrapper is still
    in place)."""
    if model.__dict__.get("forward") is not wrapper:
        return
    del model.forward
    if wrapper.zoe_own:
        model.forward = wrapper.zoe_inner
