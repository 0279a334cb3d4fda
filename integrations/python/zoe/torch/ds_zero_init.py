"""zoe.torch.zero_init from a DeepSpeed configuration, as DeepSpeed's
``zero.Init(config_dict_or_path=...)``: the model is built paged into the engine that
zoe.torch.initialize makes at stage 3 from the same configuration, and initialize then takes
that engine, with the model, instead of making its own.

``zero_init_target`` makes the engine (the document initialize would make: ds_config.read_config,
over the same data-parallel group, its NVMe directories created) and says where and in which
dtype the parameters go: the configuration's offload_param home, sharded over the group, in fp16
or bf16 when the configuration trains in it (as initialize casts the module). The engine carries
its document; ``adopted_engine`` finds it on the module's paged parameters at initialize and
checks that initialize was given the same configuration."""

import torch

from .._capi import Tier
from ..engine import Engine
from .adoption import init_record
from .common import _invalid
from .ds_config import data_parallel_group, read_config

DOCUMENT_ATTRIBUTE = "_zoe_zero_init_document"  # on an engine zero_init made from a config


class ZeroInitTarget:
    """Where zero_init pages a model built for a configuration: the engine, the data-parallel
    group (None: one process), the home and the dtype (None: as built)."""

    def __init__(self, engine, group, home, dtype):
        self.engine = engine
        self.group = group
        self.home = home
        self.dtype = dtype


def zero_init_target(config, process_group):
    """The ZeroInitTarget of a DeepSpeed ``config`` (a dict, JSON text or path) over
    ``process_group`` (None: the default group when torch.distributed is initialized);
    InvalidArgument for a configuration below stage 3, whose parameters are not paged."""
    group = data_parallel_group(process_group)
    training, document = read_config(config, group, caller="zero_init")
    if training.zero_stage != 3:
        raise _invalid(f"zoe.torch.zero_init(config=...) builds a model paged for ZeRO stage 3; "
                       f"the configuration's zero_optimization.stage is {training.zero_stage}: "
                       "set it to 3, or build the model without zero_init")
    engine = Engine(document)
    setattr(engine, DOCUMENT_ATTRIBUTE, document)
    home = Tier.NVME if training.offload_param == "nvme" else Tier.HOST
    dtype = (torch.float16 if training.fp16 is not None else
             torch.bfloat16 if training.bf16 else None)
    return ZeroInitTarget(engine, group, home, dtype)


def paged_engines(module):
    """The engines zero_init paged ``module``'s parameters into (those not adopted yet)."""
    engines = {}
    for param in module.parameters():
        record = init_record(param)
        if record is not None and record.state == "paged":
            engines[id(record.engine)] = record.engine
    return list(engines.values())


def adopted_engine(module, document):
    """The engine zero_init(config=...) paged ``module`` into, which initialize at stage 3
    takes as its own (None: no parameter was paged by zero_init). InvalidArgument when the
    parameters were paged into an engine of the user's, or for another configuration than
    initialize's ``document``."""
    engines = paged_engines(module)
    if not engines:
        return None
    made = [getattr(engine, DOCUMENT_ATTRIBUTE, None) for engine in engines]
    if len(engines) > 1 or made[0] is None:
        raise _invalid("the model's parameters were paged by zoe.torch.zero_init(engine) into an "
                       "engine of your own, and initialize makes its engine from the "
                       "configuration: build the model inside zoe.torch.zero_init(config=<the "
                       "DeepSpeed configuration given to initialize>) instead")
    if made[0] != document:
        raise _invalid("the model was built inside zoe.torch.zero_init(config=...) with another "
                       "DeepSpeed configuration than initialize's: give both the same one")
    return engines[0]


def check_not_paged(module, stage):
    """InvalidArgument at zero_optimization.stage 0 to 2 for a module zero_init paged: only
    stage 3 adopts paged parameters (the others would train their placeholders)."""
    if paged_engines(module):
        raise _invalid(f"the model was built inside zoe.torch.zero_init, which pages its "
                       "parameters for ZeRO stage 3, and the configuration's "
                       f"zero_optimization.stage is {stage}: set it to 3, or build the model "
                       "without zero_init")
