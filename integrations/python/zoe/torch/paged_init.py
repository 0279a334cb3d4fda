"""zoe.torch.zero_init: parameters paged as their modules are constructed (DeepSpeed's
``zero.Init``), so that a model never exists whole in DRAM; offload_parameters then adopts them.

Interception: while the context is active, the ``__init__`` of every torch.nn.Module subclass
that defines one (those existing when it starts, found through ``__subclasses__``, and those
defined inside it, through ``Module.__init_subclass__``) is wrapped. The wrapper counts how
deep a module is in its own ``__init__`` chain (``super().__init__()`` calls nest); when the
outermost one returns, every parameter of the module and its submodules that is not paged yet
is written into a new zoe tensor homed where ``zero_optimization.offload_param`` says, its
``param.data`` replaced by a placeholder (one NaN expanded to its shape, one zero for integer
dtypes: adoption.construction_placeholder), and an adoption.InitRecord attached. Submodules
finish first, so a module's memory is freed as soon as it is built: the DRAM in use at once is
about the largest module's own parameters (a module that creates its parameters before its
submodules holds them until its ``__init__`` returns).
Construction itself is untouched: the random number generator is consumed exactly as without
the context, so the values are those of the same model built normally.

Re-initialisation by ``Module.apply``: a constructor that ends by initialising every submodule
(``self.apply(self._init_weights)``, as Hugging Face's ``post_init`` and many GPTs do) runs after
its submodules' parameters were paged. While the context is active, ``Module.apply`` visits the
modules as torch's does (children first) and calls ``fn(module)`` with that module's own paged
parameters acquired and ``param.data`` pointing at their values (a copy on the parameter's
device for one not on the CPU, and in the dtype the module built it in for one paged in
another), written back when ``fn`` returns, so in-place initialisers work and consume the random
number generator as without the context: one module's parameters are in memory at a time. With
a process group each rank holds only its shard: each parameter is gathered whole from every
rank's shard for ``fn`` (every rank builds the same modules, so every rank calls ``apply`` alike:
one broadcast of each rank's part per parameter, as DeepSpeed's GatheredParameters), and each
rank keeps its slice of what ``fn`` wrote.

With a process group, each rank keeps only its shard of every parameter (the layout of
zero3.py): each rank builds every module in full, writes its own slice and drops the rest, and
the ranks agree that every rank could write its shards (one all-reduce per module that has
parameters to page), so a failure on one rank raises on every rank.

Leaving the context restores every wrapped ``__init__``. When the construction raises, every
parameter the context paged is marked abandoned (offload_parameters refuses it) and its zoe
tensor is kept by the engine for the next zero_init on it to reuse (zoe has no way to
unregister a tensor): building the model again registers no new tensors for them. So is the
tensor of a paged parameter that construction drops (a weight replaced by a tie, a parameter
given other data) once it is gone. A parameter paged here carries an adoption.InitRecord until
a pager adopts it; adoption.py keeps what construction wrote into it since in its tensor.
"""

import contextlib
import functools
import itertools
import weakref

import torch
import torch.distributed as dist

from .. import _capi
from .._collective_ops import agreed, gather_parts, transport_failure_aborted
from ..engine import Engine
from .adoption import (RECORD_ATTRIBUTE, InitRecord, construction_placeholder, init_record,
                       settle, spare_tensors, write_new_tensor)
from .common import _PAGED_DTYPES, _invalid, _live_group, _weak_group
from .device import wrap_tier_memory
from .distributed import shard_counts
from .ds_zero_init import zero_init_target
from .offload import _home_from_config

_TENSOR_NAMES = itertools.count()  # a serial in every tensor name zero_init registers
_active = None  # the ZeroInit of the context in effect (contexts do not nest)


def _home_of(engine, home):
    """``home``, or the engine's zero_optimization.offload_param home; InvalidArgument when
    neither says where parameters live."""
    if home is not None:
        return home
    device = engine.config.get("zero_optimization", {}).get("offload_param", {}).get("device")
    if device not in ("cpu", "nvme"):
        raise _invalid(
            "zoe.torch.zero_init pages parameters to their home in "
            "zero_optimization.offload_param, but this engine's offload_param.device is "
            f"{device!r}: set zero_optimization.offload_param.device to \"cpu\" or \"nvme\" in "
            "the engine's configuration (or pass home=zoe.Tier.HOST or zoe.Tier.NVME)"
        )
    return _home_from_config(engine)


class _Sharding:
    """A process group as zero_init shards by it: held weakly, with this rank and the size."""

    def __init__(self, process_group):
        if not dist.is_initialized():
            raise _invalid(
                "process_group needs torch.distributed initialised (init_process_group) first"
            )
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self._group = _weak_group(process_group)

    @property
    def group(self):
        return _live_group(self._group, "zoe.torch.zero_init")


class ZeroInit:
    """What ``with zoe.torch.zero_init(...) as construction:`` yields: the engine, the home,
    and what the construction paged so far: ``parameters`` (count), ``bytes`` (of the zoe
    tensors: this rank's shards with a process group), ``registered`` (zoe tensors registered)
    and ``reused`` (spare tensors of the engine written again: those of parameters a
    construction that raised paged, or that construction dropped)."""

    def __init__(self, engine, home, sharding, dtype=None):
        self.engine = engine
        self.home = home
        self.sharding = sharding
        self.dtype = dtype  # floating parameters are paged in it (None: as built)
        self.owns_engine = False  # made for a configuration (closed when construction raises)
        self.parameters = 0
        self.bytes = 0
        self.registered = 0
        self.reused = 0
        self._records = []  # InitRecord of every parameter paged, for abandon()
        self._depths = {}  # id(module) -> how many of its __init__s are running

    # --- the wrapped __init__ ---------------------------------------------------------------

    def enter(self, module):
        """A wrapped ``__init__`` of ``module`` starts."""
        self._depths[id(module)] = self._depths.get(id(module), 0) + 1

    def leave(self, module):
        """A wrapped ``__init__`` of ``module`` ended; True when it was the outermost."""
        depth = self._depths.pop(id(module)) - 1
        if depth:
            self._depths[id(module)] = depth
        return depth == 0

    # --- paging -------------------------------------------------------------------------------

    def page(self, module):
        """Pages every parameter of ``module`` and its submodules not paged yet."""
        pending = [(name, param) for name, param in module.named_parameters()
                   if _unpaged(name, param) and not _is_lazy(param) and param.numel()]
        if not pending:
            return
        for name, param in pending:
            if param.dtype not in _PAGED_DTYPES:
                raise _invalid(f"parameter {name!r} of {type(module).__name__}: {param.dtype} "
                               "cannot be paged")
        label = type(module).__name__
        built = [param.dtype for _, param in pending]
        with torch.no_grad():
            if self.dtype is not None:  # as initialize casts the module: module.to(dtype)
                for _, param in pending:
                    if param.is_floating_point():
                        param.data = param.data.to(self.dtype)
            if self.sharding is None:
                for name, param in pending:
                    self._page_whole(f"{label}.{name}", param)
            else:
                agreed(f"zero_init paging the parameters of a {label}",
                       lambda: self._page_shards(label, pending), self.sharding.group)
        for (_, param), dtype in zip(pending, built):
            init_record(param).built_dtype = dtype

    def _page_whole(self, name, param):
        tensor = self._write(name, param)
        self._attach(param, InitRecord(self.engine, self.home, tensor, self._placeholder(param)))

    def _page_shards(self, label, pending):
        for name, param in pending:
            self._page_shard(f"{label}.{name}", param)

    def _page_shard(self, name, param):
        """Writes this rank's shard of ``param`` (zero3.py's layout) and drops the rest."""
        counts = shard_counts(param.numel(), self.sharding.world_size)
        rank = self.sharding.rank
        begin, count = sum(counts[:rank]), counts[rank]
        tensor = None
        if count:
            flat = param.detach().contiguous().view(-1)
            tensor = self._write(name, flat[begin : begin + count])
        record = InitRecord(self.engine, self.home, tensor, self._placeholder(param),
                            counts, rank)
        self._attach(param, record)

    @staticmethod
    def _placeholder(param):
        return construction_placeholder(param.shape, param.dtype, param.device)

    def _write(self, name, values):
        """A zoe tensor holding ``values``: a spare one of the same size, dtype and home when
        the engine has one, else one registered now."""
        nbytes = values.numel() * values.element_size()
        spares = spare_tensors(self.engine).get((nbytes, values.dtype, self.home))
        if spares:
            tensor, name = spares.pop(), None
            self.reused += 1
        else:
            tensor, name = None, f"param.zero_init.{next(_TENSOR_NAMES)}.{name}"
            self.registered += 1
        tensor = write_new_tensor(self.engine, name, values, self.home, tensor)
        self.bytes += nbytes
        return tensor

    def _attach(self, param, record):
        param.data = record.placeholder
        record.version = param._version
        setattr(param, RECORD_ATTRIBUTE, record)
        # A parameter that dies before a pager adopts it (a weight a tie replaced) leaves its
        # tensor to the engine's spares.
        weakref.finalize(param, record.release, "dropped").atexit = False
        self._records.append(record)
        self.parameters += 1

    @torch.no_grad()
    def call_materialized(self, module, fn):
        """``fn(module)`` with the module's own paged parameters readable and writable (see
        "Re-initialisation by Module.apply")."""
        paged = [(param, init_record(param)) for param in module.parameters(recurse=False)]
        paged = [(param, record) for param, record in paged
                 if record is not None and record.state == "paged"]
        if self.sharding is not None:
            return self._call_gathered(module, fn, paged)
        paged = [(param, record) for param, record in paged if record.tensor is not None]
        held = []
        try:
            for param, record in paged:
                held.append((param, record, _materialize(param, record)))
            return fn(module)
        finally:
            for param, record, (view, values) in held:
                if values is not view:
                    view.copy_(values.to(view.device))
                param.data = record.placeholder
                record.version = param._version
                record.tensor.release()

    def _call_gathered(self, module, fn, paged):
        """Sharded: ``fn(module)`` with each of ``paged`` gathered whole from every rank's shard
        (every rank builds the same modules and calls apply alike: one broadcast of each
        rank's part per parameter), then this rank's slice of what ``fn`` left written back
        into its shard."""
        held = []
        try:
            for param, record in paged:
                held.append((param, record, self._gathered(module, param, record)))
            return fn(module)
        finally:
            for param, record, values in held:
                _write_own_slice(record, values)
                param.data = record.placeholder
                record.version = param._version

    def _gathered(self, module, param, record):
        """``param``'s whole values gathered from the ranks' shards (as bytes), in the dtype its
        module built it in, on its device; param.data points at them."""
        stored = record.placeholder.dtype
        size = record.placeholder.element_size()
        whole = torch.empty(param.numel() * size, dtype=torch.uint8)
        parts = list(whole.split([count * size for count in record.counts]))
        if record.tensor is not None:
            with record.tensor.acquired(_capi.Tier.HOST, _capi.Access.READ) as memory:
                parts[record.rank].copy_(torch.frombuffer(memory, dtype=torch.uint8,
                                                          count=parts[record.rank].numel()))
        what = f"zero_init: gathering a parameter of a {type(module).__name__} for Module.apply"
        with transport_failure_aborted(what):
            gather_parts(parts, self.sharding.group)
        values = whole.view(stored).view(param.shape)
        param.data = values.to(param.device, record.built_dtype or stored)
        return param.data

    def abandon(self):
        """The construction raised: every parameter it paged is abandoned and its tensor kept
        for the next zero_init on the engine."""
        for record in self._records:
            record.release("abandoned")  # those adopted meanwhile stay with their pager
        self._records = []


@torch.no_grad()
def _write_own_slice(record, values):
    """This rank's slice of a parameter's whole ``values`` into its shard (none when empty), in
    the dtype it is paged in."""
    if record.tensor is None:
        return
    begin, count = sum(record.counts[:record.rank]), record.counts[record.rank]
    stored = record.placeholder.dtype
    flat = values.detach().reshape(-1)[begin : begin + count].to("cpu", stored)
    with record.tensor.acquired(_capi.Tier.HOST, _capi.Access.WRITE) as memory:
        torch.frombuffer(memory, dtype=stored, count=count).copy_(flat)


def _materialize(param, record):
    """Acquires a paged parameter's tensor for writing and points param.data at its values (a
    copy on the parameter's device when that is not the CPU, or in the dtype the module built
    it in when paged in another, so that initialisers draw as without the context): (the
    tensor's view, the values param.data points at)."""
    address = record.tensor.acquire(_capi.Tier.HOST, _capi.Access.READ_WRITE)
    view = wrap_tier_memory(address, record.tensor.nbytes, param.dtype,
                            torch.device("cpu")).view(param.shape)
    built = record.built_dtype or view.dtype
    moved = param.device.type != "cpu" or built != view.dtype
    values = view.to(param.device, built) if moved else view
    param.data = values
    return view, values


def _unpaged(name, param):
    """Whether ``param`` is not paged: zero_init never paged it, or it was given other data
    since (then its record is dropped and its tensor kept as a spare). A paged parameter
    filled in place since is written again (adoption.settle)."""
    record = init_record(param)
    return record is None or not settle(name, param, record)


def _is_lazy(param):
    return torch.nn.parameter.is_lazy(param)


# --- interception of torch.nn.Module.__init__ ------------------------------------------------


def _module_classes():
    """torch.nn.Module and every subclass of it defined so far."""
    found, pending = {torch.nn.Module}, [torch.nn.Module]
    while pending:
        for subclass in pending.pop().__subclasses__():
            if subclass not in found:
                found.add(subclass)
                pending.append(subclass)
    return found


class _Interception:
    """The wrapped ``__init__`` of every module class, and Module.__init_subclass__ wrapping
    those defined meanwhile, while a construction is active; uninstall() restores them."""

    def __init__(self, construction):
        self.construction = construction
        self.originals = {}  # class -> the __init__ it defined
        self.init_subclass = torch.nn.Module.__dict__.get("__init_subclass__")
        self.apply = torch.nn.Module.__dict__["apply"]

    def install(self):
        try:
            for cls in _module_classes():
                self.wrap(cls)
            torch.nn.Module.__init_subclass__ = classmethod(self._init_subclass_hook())
            torch.nn.Module.apply = self._apply_hook()
        except BaseException:
            self.uninstall()
            raise

    def uninstall(self):
        """Gives every wrapped class its own __init__ back, and Module its __init_subclass__
        and apply."""
        torch.nn.Module.apply = self.apply
        if self.init_subclass is None:
            if "__init_subclass__" in torch.nn.Module.__dict__:
                delattr(torch.nn.Module, "__init_subclass__")
        else:
            torch.nn.Module.__init_subclass__ = self.init_subclass
        originals, self.originals = self.originals, {}
        for cls, original in originals.items():
            type.__setattr__(cls, "__init__", original)

    def wrap(self, cls):
        """Wraps the __init__ ``cls`` defines itself (one it inherits is wrapped where it is
        defined)."""
        original = cls.__dict__.get("__init__")
        if original is None or cls in self.originals or not callable(original):
            return
        try:
            type.__setattr__(cls, "__init__", self._wrapper(original))
        except TypeError:
            return  # a class that cannot be changed: its modules are paged by their parents
        self.originals[cls] = original

    def _wrapper(self, original):
        construction = self.construction

        @functools.wraps(original)
        def __init__(module, *args, **kwargs):
            construction.enter(module)
            try:
                original(module, *args, **kwargs)
            finally:
                outermost = construction.leave(module)
            if outermost:
                construction.page(module)
        return __init__

    def _apply_hook(self):
        construction = self.construction

        @functools.wraps(self.apply)
        def apply(module, fn):
            for child in module.children():
                child.apply(fn)
            construction.call_materialized(module, fn)
            return module
        return apply

    def _init_subclass_hook(self):
        interception, inherited = self, self.init_subclass

        def __init_subclass__(cls, **kwargs):
            if inherited is not None:
                inherited.__get__(None, cls)(**kwargs)
            else:
                super(torch.nn.Module, cls).__init_subclass__(**kwargs)
            interception.wrap(cls)
        return __init_subclass__


@contextlib.contextmanager
def zero_init(engine=None, process_group=None, home=None, *, config=None,
              config_dict_or_path=None):
    """``with zoe.torch.zero_init(engine): model = build()`` pages every parameter as its
    module is constructed (see the module docstring), so the model never exists whole in DRAM;
    then ``offload_parameters(model, engine)`` (with the same process_group and home) adopts
    them instead of registering them again, and the pager behaves as for a model built first.
    ``with zoe.torch.zero_init(config=ds_config): model = build()`` (or
    ``config_dict_or_path=``, DeepSpeed's zero.Init keyword; a DeepSpeed configuration given
    in place of ``engine`` is taken the same way) pages into the engine zoe.torch.initialize
    then takes, with the model, when given the same configuration (ds_zero_init.py): over the
    default process group when torch.distributed is initialized, in the configuration's
    offload_param home and in its fp16 or bf16 (the context's ``engine`` attribute is it).

    * ``home``: where the parameters live (zoe.Tier.HOST or NVME); None follows the engine's
      ``zero_optimization.offload_param.device`` ("cpu": HOST, "nvme": NVME), as
      offload_parameters does; InvalidArgument when that is "none" (the default).
    * ``process_group``: each rank keeps only its shard of every parameter from the start,
      as offload_parameters(..., process_group=pg) shards them; every rank builds the same
      model with the same seed (each writes its slice of the values it built).
    * Values: the model's parameters are those of building it without the context (the
      random number generator is consumed identically); until offload_parameters adopts them
      they read as NaN (zero for integer dtypes). Converting the model (``.to``, ``.cuda()``,
      ``.half()``) before adoption is refused by offload_parameters: build it in its dtype
      and on its device inside the context.
    * Only modules whose ``__init__`` runs inside the context are paged as built; parameters
      created outside any module's ``__init__`` stay in DRAM and offload_parameters registers
      them as usual. Modules built by other threads meanwhile are paged too.
    * Leaving the context, normally or by an exception, restores every class's __init__. An
      exception abandons every parameter paged meanwhile (offload_parameters refuses them)
      and keeps their zoe tensors for the next zero_init on the engine to reuse (an engine
      made from a configuration is closed).
    * Contexts do not nest (InvalidArgument).

    Yields a :class:`ZeroInit` with counts of what was paged.
    """
    global _active
    if _active is not None:
        raise _invalid("zoe.torch.zero_init contexts do not nest: one is already active")
    construction = _construction(engine, process_group, home, config, config_dict_or_path)
    interception = _Interception(construction)
    interception.install()
    _active = construction
    try:
        yield construction
    except BaseException:
        construction.abandon()
        if construction.owns_engine:
            construction.engine.close()
        raise
    finally:
        _active = None
        interception.uninstall()


def _construction(engine, process_group, home, config, config_dict_or_path):
    """The ZeroInit of zero_init's arguments: over ``engine`` (a zoe.Engine), or over the
    engine made for a DeepSpeed configuration (``config``, ``config_dict_or_path`` or one
    given as ``engine``: ds_zero_init.zero_init_target)."""
    given = [value for value in (config, config_dict_or_path) if value is not None]
    if engine is not None and not isinstance(engine, Engine):
        given.append(engine)
        engine = None
    if len(given) + (engine is not None) != 1:
        raise _invalid("zoe.torch.zero_init takes one of: a zoe.Engine, or a DeepSpeed "
                       "configuration (config= or config_dict_or_path=: a dict, JSON text or a "
                       "path) for zoe.torch.initialize to take with the model")
    if engine is not None:
        sharding = None if process_group is None else _Sharding(process_group)
        return ZeroInit(engine, _home_of(engine, home), sharding)
    target = zero_init_target(given[0], process_group)
    sharding = None if target.group is None else _Sharding(target.group)
    construction = ZeroInit(target.engine, target.home if home is None else home, sharding,
                            target.dtype)
    construction.owns_engine = True
    return construction
