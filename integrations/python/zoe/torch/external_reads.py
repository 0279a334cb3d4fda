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
is none. Outside every forward a read
still gets the placeholder: the pager's ``materialized()`` is the way to read values there (a
collective at stage 3, which a read by one rank's code alone must not start)."""

import collections


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
    parameters) it holds: its module's own, held by the pager's pre-hook, and those acquired
    for it because they were read during it."""

    def __init__(self):
        self._frames = []  # (ids of the items the forward holds, the items acquired for it)

    def running(self):
        return bool(self._frames)

    def begin(self, own=()):
        """A forward begins, holding ``own`` (its module's items)."""
        self._frames.append(({id(item) for item in own}, []))

    def holds(self, item):
        """Whether the innermost forward holds ``item`` (one must be running)."""
        return id(item) in self._frames[-1][0]

    def add(self, item):
        """``item`` was acquired for the innermost forward (one must be running)."""
        held, acquired = self._frames[-1]
        held.add(id(item))
        acquired.append(item)

    def end(self, release):
        """The innermost forward ended: ``release(item)`` for each item acquired for it."""
        if self._frames:
            for item in self._frames.pop()[1]:
                release(item)

    def end_all(self, release):
        """Every forward left running ended, innermost first (a forward that raised ran no
        forward hook, and a recomputation torch stopped early neither)."""
        while self._frames:
            self.end(release)


def end_frames_when_raising(model, on_raise):
    """Wraps ``model.forward`` so that a forward that raises calls ``on_raise()`` before the
    exception leaves it: no forward hook runs then, and the pager must end the frames left
    running (a frame left running would make later reads acquire: at stage 3, start a
    collective on one rank). Returns the wrapper, for stop_ending_frames."""
    inner = model.forward

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
