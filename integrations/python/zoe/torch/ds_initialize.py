"""zoe.torch.initialize: DeepSpeed's ``deepspeed.initialize`` over zoe. It reads the DeepSpeed
configuration (ds_config.py), casts the module for fp16/bf16, builds the optimizer (zoe.torch
AdamW, Adam, Adagrad or Lion from the config's ``optimizer``, sharded over the process group at
ZeRO stages 1 and 2), the schedule (lr_schedules.py) and the loss scaler (loss_scaler.py), and
returns ``(engine, optimizer, training_dataloader, lr_scheduler)`` with engine a
ds_engine.DeepSpeedEngine.

At ZeRO stage 3 the module's parameters are paged through a zoe engine and sharded over the
process group, and the optimizer steps the shards (ds_stage3.py), in the param groups
``model_parameters=`` gives (each group's settings over the config optimizer's), or in one, or
in the param groups of a torch optimizer given (below).

A user's ``optimizer`` is honoured when it is a zoe.torch optimizer (its own stage and clipping
must agree with the config's; not at stage 3, where the optimizer must be built over the shards)
or, at stage 0 without offload, any torch optimizer (the engine clips and averages). Where zoe
partitions or offloads (stages 1 to 3, or offload_optimizer), a fresh torch.optim.AdamW, Adam
or Adagrad is stepped by zoe's own in its place, over the very same param group dicts, as
DeepSpeed's ZeRO optimizer wraps a client optimizer: each group's hyper-parameters are the torch
optimizer's, and a schedule over either optimizer sets the rates of both (at stage 3 the dicts
hold what zoe steps: over ranks this rank's shards, in one process the paged parameters); other
torch optimizers are refused naming the ones zoe takes. At stage 3 the optimizer holds the
trainable parameters only (the frozen ones stay paged, and the checkpoints keep their values), as
DeepSpeed's leaves out the parameters without requires_grad. A user's ``lr_scheduler`` is a torch
scheduler over the engine's optimizer or a function of the optimizer returning one. Giving one
in both places is refused, as each setting lives in one place."""

import dataclasses
import logging

import torch
import torch.distributed as dist

from ..engine import check_config
from .activation_checkpoint import configure_checkpointing
from .common import _invalid, check_nccl_device
from .ds_config import data_parallel_group, read_config
from .ds_engine import DeepSpeedEngine
from .ds_zero_init import check_not_paged
from .ds_stage3 import stage3_setup
from .loss_scaler import loss_scaler_for
from .lr_schedules import schedule_from_config
from .optimizer import OPTIMIZERS, ZoeOptimizer
from .param_memory import check_contiguous, check_no_shared_memory

log = logging.getLogger("zoe.torch")


def check_model_device(params, backend):
    """InvalidArgument for trained parameters (tensors, or param-group dicts) a NCCL process
    group (``backend`` "nccl") cannot reduce and gather: on the CPU, or on a GPU other than the
    current one (common.check_nccl_device)."""
    if backend != "nccl":
        return
    tensors = []
    for item in params:
        if not isinstance(item, dict):
            tensors.append(item)
            continue
        inner = item["params"]  # read into a list, as torch's add_param_group reads it
        item["params"] = [inner] if isinstance(inner, torch.Tensor) else list(inner)
        tensors.extend(item["params"])
    for device in sorted({tensor.device for tensor in tensors}, key=str):
        if device.type != "cuda":
            raise _invalid(f"the model has parameters on {device} and the process group is "
                           "NCCL's, which reduces GPU tensors: move the model to this rank's "
                           "GPU, or use a gloo process group")
        check_nccl_device(device, "the model", "before moving the model there")


def _config_of(args, config, config_params):
    """The configuration from config=, config_params= (DeepSpeed's older name) or
    args.deepspeed_config; giving two is refused."""
    given = [value for value in (config, config_params,
                                 getattr(args, "deepspeed_config", None)) if value is not None]
    if len(given) > 1:
        raise _invalid("the DeepSpeed configuration is given twice (config=, config_params= or "
                       "args.deepspeed_config); give it once")
    return given[0] if given else None


def _cast_module(module, training):
    """The module in fp16 or bf16 when the config enables it, as DeepSpeed casts it."""
    if training.fp16 is not None:
        return module.half()
    if training.bf16:
        return module.to(torch.bfloat16)
    return module


# TrainingConfig.grad_accum_dtype -> the zoe optimizer's grad_accum_dtype
_ACCUMULATION_DTYPES = {None: None, "fp32": torch.float32}


def _zoe_optimizer(spec, params, training, document, group):
    """The zoe.torch optimizer the config's optimizer section names (ds_config's spec),
    sharded over ``group`` at stages 1 and 2."""
    options = dict(spec["params"], grad_accum_dtype=_ACCUMULATION_DTYPES[training.grad_accum_dtype])
    if group is not None and training.zero_stage in (1, 2):
        options.update(process_group=group, zero_stage=training.zero_stage)
        if training.reduce_bucket_size is not None:
            options["bucket_elements"] = training.reduce_bucket_size
    return OPTIMIZERS[spec["type"]](params, config=document, **options)


# The torch optimizers zoe steps in place of the user's where it partitions or offloads.
_ZOE_EQUIVALENTS = {torch.optim.AdamW: "AdamW", torch.optim.Adam: "Adam",
                    torch.optim.Adagrad: "Adagrad"}


def _equivalent_spec(optimizer):
    """The optimizer spec (as ds_config's) of zoe's equivalent of a fresh torch AdamW, Adam or
    Adagrad, its settings left to the torch optimizer's param group dicts; InvalidArgument for
    another torch optimizer, or one that took steps."""
    kind = _ZOE_EQUIVALENTS.get(type(optimizer))
    if kind is None:
        raise _invalid(
            f"optimizer {type(optimizer).__name__} is a torch optimizer zoe cannot step: where "
            "zoe partitions or offloads (zero_optimization.stage 1 to 3, offload_optimizer) it "
            "steps torch.optim.AdamW, Adam and Adagrad in their place; pass one of those or "
            "zoe.torch.AdamW(...), name the optimizer in the config, or give "
            "zero_optimization.stage 0 without offload_optimizer")
    if any(float(state.get("step", 0)) > 0 for state in optimizer.state.values()):
        raise _invalid(f"the torch {kind} given has state (it has taken steps): zoe steps its "
                       "param groups with state of its own; pass a fresh one, or load its "
                       "state_dict() into the optimizer initialize returns")
    return {"type": kind, "params": {}}


def _zoe_in_place_of(optimizer, training, document, group):
    """zoe's optimizer over the param group dicts of a fresh torch AdamW, Adam or Adagrad
    (the same dicts: a schedule over either sets the rates of both), sharded as the config
    says (stages 1 and 2; _equivalent_spec says which torch optimizers)."""
    return _zoe_optimizer(_equivalent_spec(optimizer), optimizer.param_groups, training,
                          document, group)


def _check_user_optimizer(optimizer, training):
    """InvalidArgument for a user optimizer the engine could not drive as the config asks."""
    if training.optimizer is not None:
        raise _invalid("an optimizer is given both to initialize and in the config's "
                       "'optimizer' section; remove one of them")
    if isinstance(optimizer, ZoeOptimizer):
        stage = getattr(optimizer._zero, "stage", None)
        if stage is not None and stage != training.zero_stage:
            raise _invalid(f"the optimizer given is sharded at ZeRO stage {stage} but the "
                           f"config's zero_optimization.stage is {training.zero_stage}; make "
                           "them agree")
        _check_user_clipping(optimizer, training)
        _check_user_speculation(optimizer, training)
        _check_user_buckets(optimizer, training)
    _check_user_accumulation(optimizer, training)


def _check_user_accumulation(optimizer, training):
    """The micro-batches must add up where the config's data_types.grad_accum_dtype says: a zoe
    optimizer's grad_accum_dtype must be it, and a torch optimizer that torch steps (stage 0
    without offload_optimizer) has only .grad, in the model's dtype."""
    wanted = _ACCUMULATION_DTYPES[training.grad_accum_dtype]
    if isinstance(optimizer, ZoeOptimizer):
        given = optimizer.accumulation.dtype
        if given != wanted:
            raise _invalid(f"the optimizer given adds micro-batches up {_accumulating_in(given)} "
                           "but the config's data_types.grad_accum_dtype says "
                           f"{_accumulating_in(wanted)}; construct it with "
                           f"grad_accum_dtype={'torch.float32' if wanted else 'None'}, or "
                           "make the config say the same")
    elif wanted is not None and not _zoe_steps_torch_optimizers(training):
        raise _invalid('data_types.grad_accum_dtype "fp32" needs zoe\'s optimizer, which keeps '
                       "fp32 sums of the micro-batches: the torch optimizer given steps on "
                       ".grad, in the model's dtype, at zero_optimization.stage 0 without "
                       "offload_optimizer. Name the optimizer in the config, pass a "
                       "zoe.torch optimizer with grad_accum_dtype=torch.float32, or remove "
                       "data_types.grad_accum_dtype")


def _accumulating_in(dtype):
    return "in .grad, in the model's dtype" if dtype is None else "in fp32"


def _check_user_buckets(optimizer, training):
    """A sharded zoe optimizer reduces in its own buckets: they must be the config's
    reduce_bucket_size when it gives one."""
    wanted = training.reduce_bucket_size
    given = getattr(optimizer._zero, "bucket_elements", None)
    if wanted is not None and given is not None and given != wanted:
        raise _invalid(f"the optimizer given reduces buckets of {given} elements but the "
                       f"config's zero_optimization.reduce_bucket_size is {wanted}; construct "
                       f"it with bucket_elements={wanted}, or leave the key out")


def _check_user_clipping(optimizer, training):
    """A zoe optimizer clips inside its step: it must clip as the config's gradient_clipping
    says (its max_grad_norm, else its engine's gradient_clipping)."""
    clipping = optimizer._max_grad_norm
    if clipping is None:
        clipping = optimizer.engine.config.get("gradient_clipping", 0.0)
    if float(clipping or 0.0) != training.gradient_clipping:
        raise _invalid(f"the optimizer given clips to {clipping or 0.0} but the config's "
                       f"gradient_clipping is {training.gradient_clipping}; construct it with "
                       f"max_grad_norm={training.gradient_clipping} (0.0: none)")


def _check_user_speculation(optimizer, training):
    """A zoe optimizer with device param groups, given with a config that sets zoe.speculative,
    must speculate as it says (the optimizer's own speculative, else its engine's
    zoe.speculative); CPU param groups never speculate, so there it does not matter."""
    zoe_section = training.document.get("zoe")
    configured = zoe_section.get("speculative") if isinstance(zoe_section, dict) else None
    on_device = any(state.device is not None for state in optimizer._groups)
    if configured is not None and on_device and bool(configured) != optimizer._speculative:
        raise _invalid(f"the optimizer given {'does not speculate' if configured else 'speculates'}"
                       f" but the config's zoe.speculative is {str(bool(configured)).lower()}; "
                       f"construct it with speculative={bool(configured)}, or leave "
                       "zoe.speculative out of the config")


def _zoe_steps_torch_optimizers(training):
    """Whether zoe partitions or offloads, so that a torch optimizer is stepped by zoe's."""
    return training.zero_stage != 0 or training.offload_optimizer != "none"


def _build_optimizer(optimizer, params, training, document, group):
    """(the optimizer, whether the engine owns it)."""
    if optimizer is not None:
        _check_user_optimizer(optimizer, training)
        if not isinstance(optimizer, ZoeOptimizer) and _zoe_steps_torch_optimizers(training):
            return _zoe_in_place_of(optimizer, training, document, group), True
        for warning in check_config(document):  # no engine of initialize's reads it
            log.warning("%s", warning)
        return optimizer, False
    if training.optimizer is None:
        raise _invalid("no optimizer: give the config an 'optimizer' section (type AdamW, "
                       "Adam, Adagrad or Lion) or pass optimizer= to initialize")
    return _zoe_optimizer(training.optimizer, params, training, document, group), True


def _stage3_param_groups(model_parameters, module):
    """The param groups stage 3 builds its optimizer over: None (one group of every trainable
    parameter, the config's settings) for no model_parameters= or the module's parameters; for
    param groups (dicts), copies of them with their parameters listed (ds_stage3._optimized
    leaves their frozen parameters out: the optimizer holds the trainable ones only, as
    DeepSpeed's). InvalidArgument for what stage 3 would not honour: other parameters than the
    module's trainable ones, or groups that miss or repeat one (the optimizer steps every
    trainable parameter's shard)."""
    if model_parameters is None:
        return None
    given = list(model_parameters)
    if not any(isinstance(item, dict) for item in given):
        _check_stage3_tensors(given, module)
        return None
    if not all(isinstance(item, dict) for item in given):
        raise _invalid("model_parameters= mixes param groups (dicts) and tensors; put every "
                       "parameter in a group")
    groups = [dict(item, params=_listed(item["params"])) for item in given]
    _check_stage3_cover(groups, module, "model_parameters=")
    return groups


def _listed(params):
    return [params] if isinstance(params, torch.Tensor) else list(params)


def _check_stage3_tensors(given, module):
    """InvalidArgument for a model_parameters= of tensors that are not the module's trainable
    parameters."""
    trainable = {id(param) for param in module.parameters() if param.requires_grad}
    if {id(param) for param in given if param.requires_grad} != trainable:
        raise _invalid("at zero_optimization.stage 3 model_parameters= must be the module's "
                       "parameters: the optimizer steps the shard of every parameter with "
                       "requires_grad; freeze a parameter with requires_grad=False instead, and "
                       "pass model.parameters() or leave it out")


def _check_stage3_cover(groups, module, source):
    """InvalidArgument, naming the parameter, unless every trainable parameter of the module
    is in exactly one of the param ``groups`` (those of ``source``, as messages name it) and
    every parameter they hold is the module's."""
    names = {id(param): name for name, param in module.named_parameters()}
    seen = {}
    for index, group in enumerate(groups):
        for param in group["params"]:
            name = names.get(id(param))
            if name is None:
                raise _invalid(f"param group {index} of {source} holds a parameter that is not "
                               "the module's; at zero_optimization.stage 3 the groups hold the "
                               "module's own parameters")
            if id(param) in seen:
                raise _invalid(f"parameter {name!r} is in param groups {seen[id(param)]} and "
                               f"{index} of {source}; put each parameter in one group")
            seen[id(param)] = index
    missing = [name for name, param in module.named_parameters()
               if param.requires_grad and id(param) not in seen]
    if missing:
        raise _invalid(f"parameter {missing[0]!r} (requires_grad) is in no param group of "
                       f"{source}: at zero_optimization.stage 3 the optimizer steps every "
                       "trainable parameter's shard; add it to a group, or freeze it with "
                       "requires_grad=False")


def _stage3_optimizer(optimizer, model_parameters, module, training, document, group):
    """(Stage3, its optimizer): the module paged (and sharded over ``group``) and zoe's
    optimizer over what this rank steps (ds_stage3.py): the config's, over model_parameters=
    (_stage3_param_groups), or zoe's equivalent of a fresh torch ``optimizer`` over that
    optimizer's own param group dicts, whose parameters become this rank's shards (a schedule
    over the torch optimizer sets zoe's rates; model_parameters= is then not read, as under
    DeepSpeed)."""
    if optimizer is None:
        if training.optimizer is None:
            raise _invalid("no optimizer: give the config an 'optimizer' section (type AdamW, "
                           "Adam, Adagrad or Lion) or pass a torch.optim.AdamW, Adam or "
                           "Adagrad as optimizer=")
        return stage3_setup(module, training.optimizer, document, training, group,
                            _stage3_param_groups(model_parameters, module))
    if isinstance(optimizer, ZoeOptimizer):
        raise _invalid("at zero_optimization.stage 3 initialize builds zoe's optimizer over the "
                       "parameter shards, and the zoe.torch optimizer given holds the full "
                       "parameters: name it in the config's 'optimizer' section, or pass a "
                       "fresh torch.optim.AdamW, Adam or Adagrad, which zoe steps in its place")
    _check_user_optimizer(optimizer, training)
    spec = _equivalent_spec(optimizer)
    _check_stage3_cover(optimizer.param_groups, module, "the optimizer given")
    return stage3_setup(module, spec, document, training, group, optimizer.param_groups)


def _build_scheduler(lr_scheduler, optimizer, training):
    """The schedule from the config, or the user's (a scheduler or a function of the
    optimizer), or None."""
    if lr_scheduler is not None and training.scheduler is not None:
        raise _invalid("a learning-rate scheduler is given both to initialize and in the "
                       "config's 'scheduler' section; remove one of them")
    if training.scheduler is not None:
        return schedule_from_config(training.scheduler, optimizer)
    if callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
        lr_scheduler = lr_scheduler(optimizer)
    scheduled = getattr(lr_scheduler, "optimizer", optimizer)
    if lr_scheduler is not None and not _same_param_groups(scheduled, optimizer):
        raise _invalid("lr_scheduler steps another optimizer than the engine's; build it over "
                       "the optimizer initialize returns, or pass a function of the optimizer")
    return lr_scheduler


def _same_param_groups(first, second):
    """Whether two optimizers are one, or share their param group dicts (a torch optimizer
    zoe steps in its place)."""
    groups = getattr(first, "param_groups", None)
    return first is second or (
        groups is not None and len(groups) == len(second.param_groups)
        and all(a is b for a, b in zip(groups, second.param_groups)))


def _dataloader(training_data, training, rank, world, collate_fn):
    """The micro-batches of DeepSpeed's DeepSpeedDataLoader (runtime/dataloader.py), None
    without training_data: each rank its share of the samples in the order of a
    DistributedSampler over the data-parallel ranks -- shuffled with seed 0, in one process
    too (DeepSpeed takes that sampler whenever LOCAL_RANK is set, which its initialize
    requires), the same order every epoch until ``loader.data_sampler.set_epoch(epoch)``."""
    if training_data is None:
        return None
    sampler = torch.utils.data.distributed.DistributedSampler(training_data, num_replicas=world,
                                                              rank=rank)
    loader = torch.utils.data.DataLoader(
        training_data, batch_size=training.batch.micro_batch_per_gpu, sampler=sampler,
        collate_fn=collate_fn, drop_last=training.dataloader_drop_last,
        pin_memory=torch.cuda.is_available())
    loader.data_sampler = sampler  # DeepSpeedDataLoader's name for it
    return loader


def _configure_checkpointing(training, optimizer, stage3):
    """The configuration's activation_checkpointing section, for zoe.torch.checkpoint: with
    cpu_checkpointing the checkpoints' inputs go to the zoe engine of the optimizer (of the
    paged parameters at stage 3)."""
    section = training.activation_checkpointing
    if section is None:
        return
    engine = stage3.engine if stage3 is not None else getattr(optimizer, "engine", None)
    if section.cpu_checkpointing and engine is None:
        raise _invalid("activation_checkpointing.cpu_checkpointing offloads checkpoints "
                       "through a zoe engine, and this configuration's optimizer has none (a "
                       "torch optimizer at stage 0): use the config's optimizer, or set "
                       "cpu_checkpointing false")
    configure_checkpointing(engine, dataclasses.asdict(section))


def _stage012_optimizer(optimizer, model_parameters, module, training, document, group):
    """(the optimizer, whether the engine owns it) at stages 0 to 2: the trainable parameters
    of model_parameters= (else the module's) on the process group's device (_build_optimizer)."""
    params = model_parameters if model_parameters is not None else module.parameters()
    params = [p for p in params if not isinstance(p, torch.Tensor) or p.requires_grad]
    if optimizer is None:  # the config's: a zoe optimizer
        check_contiguous(_trainable_named(module))
    if group is not None:  # stage 3 pages the parameters where the config says
        check_model_device(params, dist.get_backend(group))
    return _build_optimizer(optimizer, params, training, document, group)


def _trainable_named(module):
    """(description, parameter) of each of ``module``'s parameters that requires a gradient."""
    return [(f"parameter {name!r}", param) for name, param in module.named_parameters()
            if param.requires_grad]


def _warn_unread_model_parameters(model_parameters, optimizer):
    """Logs that model_parameters= is not read beside an ``optimizer`` (DeepSpeed does not read
    it either) when it holds other tensors than the optimizer's param groups."""
    if optimizer is None:
        return
    given = {id(param) for item in model_parameters
             for param in (_listed(item["params"]) if isinstance(item, dict) else [item])}
    held = {id(param) for group in optimizer.param_groups for param in group["params"]}
    if given != held:
        log.warning("model_parameters= holds other parameters than the param groups of the "
                    "optimizer given, and is not read beside optimizer= (as in DeepSpeed): the "
                    "optimizer's param groups are trained; build the optimizer over the "
                    "parameters meant, and leave model_parameters= out")


def _check_something_to_train(module, optimizer):
    """InvalidArgument when the optimizer initialize would build has nothing to train (no
    parameter of the module requires a gradient), where torch's optimizer would say only
    "optimizer got an empty parameter list"."""
    params = list(module.parameters())
    if optimizer is not None or any(param.requires_grad for param in params):
        return
    what = (f"its {len(params)} parameters are all frozen (requires_grad=False)" if params
            else "it has no parameters")
    raise _invalid(f"nothing to train: the model holds no parameter that requires a gradient "
                   f"({what}); set requires_grad on the parameters to train")


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None,
               lr_scheduler=None, mpu=None, dist_init_required=None, collate_fn=None,
               config=None, config_params=None, process_group=None):
    """DeepSpeed's initialize (see the module docstring): returns (engine, optimizer,
    training_dataloader, lr_scheduler). ``process_group`` (default: torch.distributed's default
    group when initialized) is the data-parallel group; ``mpu`` (model parallelism) is not
    supported; ``dist_init_required`` is accepted and ignored (initialize the process group
    before calling)."""
    if model is None:
        raise _invalid("initialize needs model= (a torch.nn.Module)")
    if mpu is not None:
        raise _invalid("mpu= (model parallelism) is not supported: zoe is data parallel only")
    group = data_parallel_group(process_group)
    world = 1 if group is None else dist.get_world_size(group)
    rank = 0 if group is None else dist.get_rank(group)
    training, document = read_config(_config_of(args, config, config_params), group)
    loader = _dataloader(training_data, training, rank, world, collate_fn)
    if training.zero_stage != 3:
        check_not_paged(model, training.zero_stage)
    module = _cast_module(model, training)
    if model_parameters is not None:
        model_parameters = list(model_parameters)  # a generator is read once, here
        _warn_unread_model_parameters(model_parameters, optimizer)
    _check_something_to_train(module, optimizer)
    if optimizer is None or _zoe_steps_torch_optimizers(training):
        check_no_shared_memory(_trainable_named(module))
    stage3 = None
    if training.zero_stage == 3:  # a failure puts the param groups' lists back (Stage3)
        stage3, optimizer = _stage3_optimizer(optimizer, model_parameters, module, training,
                                              document, group)
        owns = True
    else:
        optimizer, owns = _stage012_optimizer(optimizer, model_parameters, module, training,
                                              document, group)
    try:
        scheduler = _build_scheduler(lr_scheduler, optimizer, training)
        scaler = None if training.fp16 is None else loss_scaler_for(training.fp16)
        _configure_checkpointing(training, optimizer, stage3)
        engine = DeepSpeedEngine(module, optimizer, scheduler, training, group, scaler, owns,
                                 stage3)
    except BaseException:
        if stage3 is not None:
            stage3.close(optimizer)
        elif owns:
            optimizer.close()
        raise
    engine.training_dataloader = loader
    return engine, optimizer, loader, scheduler
