"""Parameters paged while their modules are constructed (zoe.torch.zero_init, paged_init.py) and
adopted by offload_parameters: the record such a parameter carries from one to the other, the
checks adoption makes, and the one way both write a parameter's values into a new zoe tensor."""

import torch

from .. import _capi
from .common import _PAGED_DTYPES, _invalid

RECORD_ATTRIBUTE = "_zoe_init"  # the InitRecord of a parameter zero_init paged
PAGER_ATTRIBUTES = ("_zoe_pager", "_zoe_sharded_pager")  # set on a parameter a pager pages
SPARES_ATTRIBUTE = "_zoe_spare_tensors"  # on an engine: spare_tensors()


def write_new_tensor(engine, name, values, home, tensor=None):
    """A zoe tensor homed in ``home`` holding a copy of ``values`` (any layout, any device):
    ``tensor`` when given (one of the same size, dtype and home, reused), else one registered as
    ``name``. Homed on NVMe, it is evicted once written: DRAM holds it only while needed."""
    flat = values.detach().contiguous().view(-1).cpu()
    if tensor is None:
        nbytes = flat.numel() * flat.element_size()
        tensor = engine.register_tensor(name, nbytes, _PAGED_DTYPES[values.dtype], home)
    with tensor.acquired(_capi.Tier.HOST, _capi.Access.WRITE) as memory:
        torch.frombuffer(memory, dtype=values.dtype, count=flat.numel()).copy_(flat)
    if home == _capi.Tier.NVME:
        tensor.evict()
    return tensor


def placeholder_for(shape, dtype, device):
    """What param.data points at while a parameter is paged: one NaN expanded to ``shape`` (one
    zero for a dtype without NaN), so that code reading a parameter outside the forward of its
    module (which gathers it) spreads NaN, not plausible zeros, while its shape stays visible."""
    value = float("nan") if dtype.is_floating_point else 0
    return torch.full((1,), value, dtype=dtype, device=device).expand(shape)


def construction_placeholder(shape, dtype, device):
    """What param.data points at from zero_init to adoption: one NaN expanded to ``shape`` (one
    zero for a dtype without NaN), so that construction code reading a paged parameter spreads
    NaN rather than plausible zeros, and any fill of it shows (written)."""
    value = float("nan") if dtype.is_floating_point else 0
    return torch.full((1,), value, dtype=dtype, device=device).expand(shape)


def _untouched(cell):
    """Whether a construction placeholder's one element still holds what it was made with."""
    if cell.is_floating_point():
        return bool(torch.isnan(cell).item())
    return not bool(cell.item())


class InitRecord:
    """How zero_init paged one parameter: the engine and home of its zoe tensor, the tensor
    (this rank's shard's with a process group; None for an empty shard), the placeholder
    param.data points at (construction_placeholder) and, with a process group, every rank's
    shard size (``counts``) and this rank.

    ``state``: "paged" (by zero_init, waiting for a pager), then one of "adopted" (a pager took
    the tensor over; the parameter's data became the pager's placeholder), "dropped" (the
    parameter was given other data, or died unadopted: the tensor became a spare of the engine)
    or "abandoned" (the zero_init that paged it raised: the tensor became a spare and the
    parameter, which belongs to no model, cannot be adopted)."""

    def __init__(self, engine, home, tensor, placeholder, counts=None, rank=None):
        self.engine = engine
        self.home = home
        self.tensor = tensor
        self.placeholder = placeholder
        self.counts = counts
        self.rank = rank
        self.state = "paged"
        self.built_dtype = None  # the dtype the module built it in, when paged in another
        self.version = None  # the parameter's version counter once paged (see written)

    def release(self, state):
        """Moves a paged record to ``state`` ("dropped" or "abandoned"): its tensor becomes a
        spare of the engine (spare_tensors) since no parameter uses it any more."""
        if self.state != "paged":
            return
        self.state = state
        if self.tensor is not None:
            key = (self.tensor.nbytes, self.placeholder.dtype, self.home)
            spare_tensors(self.engine).setdefault(key, []).append(self.tensor)


def init_record(param):
    """The InitRecord of a parameter zero_init paged, or None."""
    return getattr(param, RECORD_ATTRIBUTE, None)


def check_adoptable(named_params, engine, home, rank=None, world_size=None):
    """Refuses, before a pager changes anything, a model whose parameters it cannot take:
    one already paged by a pager, or one zero_init paged for another engine, home or
    sharding (``rank`` of ``world_size``; None for a pager without a process group), by a
    zero_init whose construction raised, or converted since. InvalidArgument naming the
    parameter."""
    for name, param in named_params:
        if any(getattr(param, attribute, None) is not None for attribute in PAGER_ATTRIBUTES):
            raise _invalid(f"parameter {name!r} is already paged (offload_parameters was called "
                           "on this model before): close what paged it first (engine.close() "
                           "for zoe.torch.initialize's engine, else pager.remove())")
        record = init_record(param)
        if record is not None:
            _check_record(name, param, record, engine, home, rank, world_size)


def _check_record(name, param, record, engine, home, rank, world_size):
    where = f"parameter {name!r} was paged by zoe.torch.zero_init"
    if record.state == "abandoned":
        raise _invalid(f"{where} whose construction raised; build the model again")
    if record.engine is not engine:
        raise _invalid(f"{where} with another engine; offload it through the same engine")
    refuse_converted(name, param, record)
    if record.home != home:
        raise _invalid(f"{where} homed in {_capi.Tier(record.home).name}; offload_parameters "
                       f"was asked for {_capi.Tier(home).name}: pass the same home (or none "
                       "to both, which follows zero_optimization.offload_param)")
    sharded_as = None if record.counts is None else (record.rank, len(record.counts))
    wanted = None if world_size is None else (rank, world_size)
    if sharded_as != wanted:
        raise _invalid(f"{where} {_sharding_words(sharded_as)}; offload_parameters pages it "
                       f"{_sharding_words(wanted)}: pass zero_init and offload_parameters the "
                       "same process_group")


def _sharding_words(sharding):
    if sharding is None:
        return "without a process group"
    return f"as rank {sharding[0]} of {sharding[1]}"


def replaced(param, record):
    """Whether ``param`` was given other data (``param.data = ...``) after zero_init paged it:
    its zoe tensor no longer holds its values."""
    data, placeholder = param.data, record.placeholder
    return data.data_ptr() != placeholder.data_ptr() or data.shape != placeholder.shape


def converted(param, record):
    """Whether ``param`` was converted to another dtype or device (model.to, .cuda(), .half())
    after zero_init paged it: the conversion saw only its placeholder."""
    data, placeholder = param.data, record.placeholder
    return data.dtype != placeholder.dtype or data.device != placeholder.device


def written(param, record):
    """Whether ``param`` was written in place after zero_init paged it: through the parameter
    (nn.init.zeros_, ones_, constant_: its version counter moved) or through ``param.data``
    (a fill_ changed its construction placeholder's one element). Both can only fill it with
    one value; other writes into a placeholder raise."""
    cell = record.placeholder.as_strided((1,), (1,))
    return param._version != record.version or not _untouched(cell)


def rewrite(param, record):
    """Writes the value ``param`` was filled with in place (see written) into its zoe tensor
    (this rank's shard of it with a process group) and gives it a fresh placeholder."""
    values = param.data
    if record.counts is not None:
        begin = sum(record.counts[: record.rank])
        values = values.reshape(-1)[begin : begin + record.counts[record.rank]]
    if record.tensor is not None:
        write_new_tensor(record.engine, None, values, record.home, record.tensor)
    record.placeholder = construction_placeholder(param.shape, param.dtype, param.device)
    param.data = record.placeholder
    record.version = param._version


def refuse_converted(name, param, record):
    """InvalidArgument when ``param`` was converted after zero_init paged it (converted)."""
    if converted(param, record):
        raise _invalid(
            f"parameter {name!r} was converted to {param.dtype} on {param.device} after "
            "zoe.torch.zero_init paged it (model.to, .cuda(), .half() before "
            "offload_parameters), which converted only its placeholder: build the model in "
            "the dtype and on the device it is to have inside zero_init (the modules' dtype= "
            "and device= arguments, torch.set_default_dtype)"
        )


def settle(name, param, record):
    """Brings a paged record up to date with what construction did to its parameter since:
    other data (replaced: the record is dropped and the parameter is unpaged) or an in-place
    fill (written: the tensor rewritten). True while the parameter stays paged. A conversion
    (converted) is refused."""
    refuse_converted(name, param, record)
    if replaced(param, record):
        drop(param, record)
        return False
    if written(param, record):
        with torch.no_grad():
            rewrite(param, record)
    return True


def drop(param, record):
    """Forgets the paging of a parameter whose data was replaced: it is an ordinary parameter
    again, and its zoe tensor a spare of the engine."""
    delattr(param, RECORD_ATTRIBUTE)
    record.release("dropped")


def spare_tensors(engine):
    """The engine's zoe tensors that no parameter uses, by (bytes, dtype, home): tensors cannot
    be unregistered, so zero_init reuses them."""
    spares = getattr(engine, SPARES_ATTRIBUTE, None)
    if spares is None:
        spares = {}
        setattr(engine, SPARES_ATTRIBUTE, spares)
    return spares


def adopt(name, param):
    """The InitRecord of ``param``, which a pager now takes over (the parameter no longer
    carries it), brought up to date (settle), its placeholder the pager's; None when its data
    was replaced since (the pager pages it afresh)."""
    record = init_record(param)
    if not settle(name, param, record):
        return None
    delattr(param, RECORD_ATTRIBUTE)
    record.state = "adopted"
    record.placeholder = placeholder_for(param.shape, param.dtype, param.device)
    param.data = record.placeholder
    return record
