"""Paged parameters read outside the forward of their own module: a tied head written by hand
(``h @ self.emb.weight.t()`` in the parent's forward), a weight shared by reading another
module's attribute. A pager makes a parameter's values present for the forward of the module
that owns it; read anywhere else it is its placeholder. So that such a read gets the values
while a forward runs (as DeepSpeed gathers its "external" parameters), the pager watches the
reads of paged parameters by name (``module.weight`` looks the parameter up in
``module._parameters``, which becomes a ReadWatchedParameters) and keeps ForwardFrames: the
forwards running now, the model's and each paged module's, innermost last. A paged parameter
read while one runs, and absent, is acquired (gathered at stage 3) for the innermost one and
released when it ends, as the module's own parameters are released then (kept for backward
when autograd saved them and the keep policy allows, at stage 3). Outside every forward a read
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
    (with the parameters it holds now)."""
    module._parameters = original(module._parameters)


class ForwardFrames:
    """The forwards running now, innermost last, each with the items (a pager's paged
    parameters) acquired for it because they were read during it."""

    def __init__(self):
        self._frames = []

    def running(self):
        return bool(self._frames)

    def begin(self):
        self._frames.append([])

    def add(self, item):
        """Holds ``item`` for the innermost forward (one must be running)."""
        self._frames[-1].append(item)

    def end(self, release):
        """The innermost forward ended: ``release(item)`` for each item acquired for it."""
        if self._frames:
            for item in self._frames.pop():
                release(item)

    def end_all(self, release):
        """Every forward left running (one that raised) ended, innermost first."""
        while self._frames:
            self.end(release)
