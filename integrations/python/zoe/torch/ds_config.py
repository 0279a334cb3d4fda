"""The training settings zoe.torch.initialize reads from a DeepSpeed configuration: batch sizes
(checked against the world size as DeepSpeed checks them), gradient clipping, the optimizer, the
scheduler, the ZeRO stage, its offload and its gradient buckets (reduce_bucket_size), fp16
loss scaling and bf16. ``"auto"`` (as Hugging Face's configurations write it) counts as "not
given": batch sizes are then derived, the buckets take zoe's default, the others DeepSpeed's;
where there is no default (a schedule's total_num_steps, the ZeRO stage) it is refused. The
sections DeepSpeed reads with pydantic are first read as pydantic reads them, by the engine's
reader (zoe_config_normalize: "false" and "2" converted there, the deprecated offload switches
turned into their sections); then each value read is checked for its type: a string, a bool or
a non-finite number where a number is needed is refused naming the key. communication_data_type is
accepted where it names what zoe does (fp32 reductions), data_types.grad_accum_dtype where zoe
accumulates micro-batches in that dtype (fp32, or the model's below stage 3), and both are
refused otherwise. What the engine itself honours
(offload placement, NVMe paths, the ``zoe`` section) and the DeepSpeed keys zoe does not act on
(checked by the engine's parser: docs/configuration.md) stay in ``document`` and reach
zoe.Engine as they are."""

import dataclasses
import json
import logging
import os
from typing import Any, Dict, Optional

import torch.distributed as dist

from .._collective_ops import agreed, by_rank, gather_objects
from ..engine import _config_text, normalize_deepspeed_config
from ..errors import as_zoe_error
from .activation_checkpoint import checkpointing_config
from .common import _invalid, whole_count
from .lr_schedules import SCHEDULES, required_parameters, torch_schedule
from .optim_kinds import finite_number

log = logging.getLogger("zoe.torch")

AUTO = "auto"

# DeepSpeed's optimizer types zoe.torch steps (its zoe.torch class of the same name; "Adam" is
# AdamW unless adam_w_mode is false), each with DeepSpeed's defaults for its params, in the
# class's argument names: deepspeed/ops/adam (Adam, AdamW), ops/adagrad, ops/lion.
OPTIMIZER_DEFAULTS = {
    "Adam": dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0),
    "AdamW": dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0),
    "Adagrad": dict(lr=1e-2, eps=1e-10, weight_decay=0.0),
    "Lion": dict(lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0),
}
# Params a type takes beyond its defaults' keys: amsgrad (its class refuses it when true),
# torch's lr_decay for Adagrad, and the ones the engine reads itself (_ENGINE_ONLY_PARAMS).
_OPTIMIZER_EXTRAS = {
    "Adam": ("amsgrad", "adam_w_mode", "torch_adam", "bias_correction"),
    "AdamW": ("amsgrad", "adam_w_mode", "torch_adam", "bias_correction"),
    "Adagrad": ("lr_decay",),
    "Lion": (),
}
# Params that are no argument of the class: adam_w_mode chooses the type, torch_adam the defaults
# (TORCH_ADAM_DEFAULTS; zoe has one implementation of the step), and the engine checks
# bias_correction (true only: zoe always corrects the bias).
_ENGINE_ONLY_PARAMS = ("adam_w_mode", "torch_adam", "bias_correction")
# Params that are true or false.
_FLAG_PARAMS = ("amsgrad", "adam_w_mode", "torch_adam", "bias_correction")
# With optimizer.params.torch_adam true DeepSpeed builds torch.optim.Adam or AdamW (runtime/
# engine.py, _configure_basic_optimizer): torch's defaults, where AdamW's weight_decay is 0.01.
TORCH_ADAM_DEFAULTS = {
    "Adam": dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0),
    "AdamW": dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2),
}

# DeepSpeed's documented fp16 defaults (runtime/constants.py).
FP16_DEFAULTS = dict(loss_scale=0.0, initial_scale_power=16, loss_scale_window=1000,
                     hysteresis=2, consecutive_hysteresis=False, min_loss_scale=1.0)


@dataclasses.dataclass
class BatchSizes:
    """train_batch_size = micro_batch_per_gpu x gradient_accumulation_steps x world_size."""
    train_batch_size: int
    micro_batch_per_gpu: int
    gradient_accumulation_steps: int


@dataclasses.dataclass
class TrainingConfig:
    """What initialize takes from a DeepSpeed configuration (see the module docstring)."""
    document: Dict[str, Any]
    batch: BatchSizes
    gradient_clipping: float
    optimizer: Optional[Dict[str, Any]]  # {"type": ..., "params": {...}} with "auto" resolved
    scheduler: Optional[Dict[str, Any]]  # {"type": ..., "params": {...}}
    zero_stage: int
    offload_optimizer: str  # "none", "cpu" or "nvme"
    offload_param: str
    fp16: Optional[Dict[str, Any]]  # DeepSpeed's fp16 settings when enabled, else None
    bf16: bool
    dataloader_drop_last: bool
    # activation_checkpointing, checked (activation_checkpoint.py); None when absent
    activation_checkpointing: Optional[Any] = None
    # zero_optimization.reduce_bucket_size in elements; None (absent or "auto"): zoe's default
    reduce_bucket_size: Optional[int] = None
    # data_types.grad_accum_dtype: "fp32" where micro-batches add up in fp32 sums of the
    # optimizer's (a 16-bit model at stages 0 to 2), else None (_grad_accum_dtype)
    grad_accum_dtype: Optional[str] = None


def load_document(config):
    """The configuration (a dict, JSON text or a path to a JSON file) as a fresh dict, the
    sections DeepSpeed reads with pydantic read as pydantic reads them (normalize_deepspeed_config:
    "false" is false there, and the deprecated offload switches become their sections)."""
    if config is None:
        raise _invalid("initialize needs a DeepSpeed configuration: config= a dict, JSON text "
                       "or the path of a JSON file (or args.deepspeed_config)")
    document = json.loads(_config_text(config) or "{}")
    if not isinstance(document, dict):
        raise _invalid("the DeepSpeed configuration must be a JSON object")
    return normalize_deepspeed_config(document)


def _given(document, key):
    """A positive integer setting, or None when absent or "auto"; refuses anything else."""
    value = document.get(key)
    if value is None or value == AUTO:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise _invalid(f"{key} = {value!r} is not allowed; it must be a positive integer "
                       '(or "auto", or left out, to derive it from the other batch settings)')
    return value


def batch_sizes(document, world_size):
    """The three batch settings, the missing ones derived, as DeepSpeed derives them
    (DeepSpeedConfig._configure_train_batch_size); InvalidArgument naming the fix when they do
    not satisfy train_batch_size = micro x accumulation x world_size."""
    train = _given(document, "train_batch_size")
    micro = _given(document, "train_micro_batch_size_per_gpu")
    accum = _given(document, "gradient_accumulation_steps")
    if train is None and micro is None:
        raise _invalid("give train_batch_size or train_micro_batch_size_per_gpu (or both): "
                       "DeepSpeed needs one of them to size the batches")
    if train is not None and micro is not None and accum is None:
        accum = max(1, train // (micro * world_size))
    elif train is not None and micro is None:
        accum = accum or 1
        micro = max(1, train // (world_size * accum))
    elif train is None:
        accum = accum or 1
        train = micro * accum * world_size
    if train != micro * accum * world_size:
        raise _invalid(
            f"train_batch_size = {train} is not train_micro_batch_size_per_gpu ({micro}) x "
            f"gradient_accumulation_steps ({accum}) x world size ({world_size}) = "
            f"{micro * accum * world_size}; set train_batch_size to "
            f"{micro * accum * world_size}, or leave one of the three out (or \"auto\") so it "
            "is derived from the others")
    return BatchSizes(train, micro, accum)


def _number(value, default, key):
    """A numeric setting named ``key``, as given once checked (optim_kinds.finite_number);
    "auto" or absent gives the default."""
    if value is None or value == AUTO:
        return default
    finite_number(value, key)
    return value


def _zero_stage(zero):
    """zero_optimization.stage: 0 (DeepSpeed's default, not the engine's 3) when absent;
    InvalidArgument naming the key for anything but 0 to 3, "auto" included (DeepSpeed defines
    none, and Hugging Face's Trainer fills none in)."""
    stage = zero.get("stage")
    if stage is None:
        return 0
    if isinstance(stage, float) and stage.is_integer():
        stage = int(stage)
    if isinstance(stage, int) and not isinstance(stage, bool) and 0 <= stage <= 3:
        return stage
    why = (' ("auto" is not a stage: neither DeepSpeed nor Hugging Face\'s Trainer chooses one;'
           " write the stage the script was run with)") if stage == AUTO else ""
    raise _invalid(f"zero_optimization.stage = {stage!r} is not allowed; allowed: 0, 1, 2 or "
                   f"3{why}")


def _optimizer_spec(document):
    """The optimizer section as {"type": the zoe.torch class's name, "params": its arguments}:
    the type checked (any case, as DeepSpeed reads it), the params checked against the type's,
    "auto" ones and those the engine reads itself (_ENGINE_ONLY_PARAMS) removed, DeepSpeed's
    defaults for the rest; None when the configuration names none."""
    section = document.get("optimizer")
    if section is None:
        return None
    given = section.get("type")
    kind = next((name for name in OPTIMIZER_DEFAULTS if name.lower() == str(given).lower()),
                None)
    if kind is None:
        raise _invalid(
            f"optimizer.type = {given!r} is not supported; zoe.torch steps "
            f"{', '.join(OPTIMIZER_DEFAULTS)} (\"Adam\" is AdamW unless adam_w_mode is "
            "false); use one of them, or leave the config's optimizer out and pass a torch "
            "optimizer to initialize (zero_optimization.stage 0)")
    params = _optimizer_params(kind, section.get("params", {}))
    if kind == "Adam" and params.get("adam_w_mode", True) is not False:
        kind = "AdamW"
    defaults = TORCH_ADAM_DEFAULTS if params.get("torch_adam") else OPTIMIZER_DEFAULTS
    arguments = dict(defaults[kind])
    arguments.update((key, value) for key, value in params.items()
                     if key not in _ENGINE_ONLY_PARAMS)
    return {"type": kind, "params": arguments}


def _optimizer_params(kind, params):
    """optimizer.params of ``kind`` without its "auto" values, each checked: a setting of the
    type, a flag true or false, betas two finite numbers (a tuple), the others a finite number;
    InvalidArgument naming the key otherwise."""
    if not isinstance(params, dict):
        raise _invalid(f"optimizer.params = {params!r} is not allowed; allowed: an object")
    allowed = tuple(OPTIMIZER_DEFAULTS[kind]) + _OPTIMIZER_EXTRAS[kind]
    checked = {}
    for key, value in params.items():
        name = f"optimizer.params.{key}"
        if key not in allowed:
            raise _invalid(f"{name} is not a setting of {kind}; allowed: {', '.join(allowed)}")
        if value == AUTO:
            continue
        if key in _FLAG_PARAMS:
            if not isinstance(value, bool):
                raise _invalid(f"{name} = {value!r} is not allowed; allowed: true or false")
            checked[key] = value
        elif key == "betas":
            if not isinstance(value, (list, tuple)) or len(value) != 2:
                raise _invalid(f"{name} = {value!r} is not allowed; allowed: two finite numbers "
                               "[beta1, beta2]")
            checked[key] = tuple(finite_number(beta, f"{name}[{index}]")
                                 for index, beta in enumerate(value))
        else:
            checked[key] = finite_number(value, name)
    return checked


def _scheduler_spec(document):
    """The scheduler section ({"type", "params"} with "auto" params removed), or None; a
    parameter the schedule has no default for (total_num_steps) given as "auto" or left out, or
    a value of the wrong type, is refused naming the key."""
    section = document.get("scheduler")
    if section is None:
        return None
    kind = section.get("type")
    params = section.get("params", {})
    if not isinstance(params, dict):
        raise _invalid(f"scheduler.params = {params!r} is not allowed; allowed: an object")
    for name in required_parameters(kind):
        if params.get(name) == AUTO:
            raise _invalid(
                f'scheduler.params.{name} = "auto": {kind} needs it, and "auto" is Hugging '
                "Face's Trainer's to fill in (from its own arguments), which zoe.torch.initialize"
                f" cannot do; give scheduler.params.{name} a number")
        if params.get(name) is None:
            raise _invalid(f"scheduler.params.{name} is missing; {kind} needs it: give it a "
                           "number")
    known = isinstance(kind, str) and kind in SCHEDULES
    if torch_schedule(kind) is not None:  # Hugging Face fills "auto" for DeepSpeed's only
        for name, value in params.items():
            if value == AUTO:
                raise _invalid(f'scheduler.params.{name} = "auto" is not allowed for {kind!r}: '
                               "Hugging Face's Trainer fills in \"auto\" for DeepSpeed's own "
                               "schedules only; give it a value")
    check = _schedule_value if known else (lambda key, value: value)
    checked = {key: check(key, value) for key, value in params.items() if value != AUTO}
    return {"type": kind, "params": checked}  # schedule_from_config refuses another type


def _schedule_value(key, value):
    """A schedule parameter: warmup_type a string (the schedule checks which), the rest a
    finite number, or for the warmup rates one per param group; InvalidArgument naming the key
    otherwise."""
    name = f"scheduler.params.{key}"
    if key == "warmup_type":
        if not isinstance(value, str):
            raise _invalid(f"{name} = {value!r} is not allowed; allowed: 'log' or 'linear'")
        return value
    if isinstance(value, (list, tuple)) and key in ("warmup_min_lr", "warmup_max_lr"):
        return [finite_number(item, f"{name}[{index}]") for index, item in enumerate(value)]
    finite_number(value, name)
    return value


def _device_of(section):
    """An offload section's device: "none", "cpu" or "nvme"."""
    if not isinstance(section, dict):
        return "none"
    return str(section.get("device", "none")).lower()


def _enabled(document, *keys):
    """Whether any of the sections ``keys`` has enabled: true ("auto" is false)."""
    return any(document.get(key, {}).get("enabled") is True for key in keys)


def _fp16_settings(document, stage):
    """DeepSpeed's fp16 settings (FP16_DEFAULTS filled in, each checked, then the scaler rule of
    DeepSpeed at ``stage``: _deepspeed_scaler_rule) when fp16 is enabled, else None."""
    if not _enabled(document, "fp16"):
        return None
    section = document["fp16"]
    settings = {}
    for key, default in FP16_DEFAULTS.items():
        value = section.get(key)
        if isinstance(default, bool):
            settings[key] = default if value in (None, AUTO) else value
            if not isinstance(settings[key], bool):
                raise _invalid(f"fp16.{key} = {value!r} is not allowed; allowed: true or false")
        else:
            settings[key] = _number(value, default, f"fp16.{key}")
    return _deepspeed_scaler_rule(settings, section, stage)


def _deepspeed_scaler_rule(settings, section, stage):
    """``settings`` as DeepSpeed's dynamic scaler at ZeRO ``stage`` takes them (loss_scaler.py):
    at stages 1 to 3 DynamicLossScaler's rule (growth_delay 0) with the documented defaults for
    the keys left out (DeepSpeed 0.17.1 on; before it a section naming no dynamic key started
    at 2^32 with hysteresis 1); at stage 0 its fp16 optimizers' own rule, which reads no
    hysteresis (1) and doubles one step later (growth_delay 1)."""
    if stage != 0:
        return dict(settings, growth_delay=0)
    if settings["loss_scale"] == 0 and settings["hysteresis"] != 1 and "hysteresis" in section:
        log.warning("fp16.hysteresis = %s is not read at zero_optimization.stage 0, as "
                    "DeepSpeed's stage 0 fp16 optimizer reads none: each overflow halves the "
                    "loss scale", section["hysteresis"])
    return dict(settings, hysteresis=1, consecutive_hysteresis=False, growth_delay=1)


def training_config(config, world_size):
    """The TrainingConfig of a DeepSpeed configuration for ``world_size`` data-parallel ranks."""
    document = load_document(config)
    zero = document.get("zero_optimization", {})
    stage = _zero_stage(zero)
    if _enabled(document, "fp16") and _enabled(document, "bf16", "bfloat16"):
        raise _invalid("fp16.enabled and bf16.enabled are both true; enable one of them")
    batch = batch_sizes(document, world_size)
    precision = ("fp16" if _enabled(document, "fp16") else
                 "bf16" if _enabled(document, "bf16", "bfloat16") else "fp32")
    _check_communication_data_type(document, precision, world_size)
    return TrainingConfig(
        document=document,
        batch=batch,
        gradient_clipping=float(_number(document.get("gradient_clipping"), 0.0,
                                        "gradient_clipping")),
        optimizer=_optimizer_spec(document),
        scheduler=_scheduler_spec(document),
        zero_stage=stage,
        offload_optimizer=_device_of(zero.get("offload_optimizer")),
        offload_param=_device_of(zero.get("offload_param")),
        fp16=_fp16_settings(document, stage),
        bf16=_enabled(document, "bf16", "bfloat16"),
        dataloader_drop_last=bool(document.get("dataloader_drop_last", False)),
        activation_checkpointing=(
            checkpointing_config(document["activation_checkpointing"])
            if "activation_checkpointing" in document else None),
        reduce_bucket_size=_reduce_bucket_size(zero),
        grad_accum_dtype=_grad_accum_dtype(document, stage, precision,
                                           batch.gradient_accumulation_steps),
    )


# The names DeepSpeed's DtypeEnum (runtime/config.py) takes for each dtype zoe may accumulate in.
_DTYPE_NAMES = {
    "fp32": ("fp32", "float32", "float", "torch.float32"),
    "fp16": ("fp16", "float16", "half", "torch.float16"),
    "bf16": ("bf16", "bfloat16", "torch.bfloat16"),
}


def _check_communication_data_type(document, precision, world_size):
    """communication_data_type, as DeepSpeed reads it (any letter case): "fp32", "fp16", "bf16"
    or none are accepted, as zoe reduces gradients over the ranks in fp32 at every stage (as
    precise as any of them; DeepSpeed's default is the model's dtype); a 16-bit dtype other than
    the model's over several ranks logs that zoe reduces in fp32. Anything else is refused naming
    the key."""
    value = document.get("communication_data_type")
    name = value.lower() if isinstance(value, str) else value
    if name is None or name == "fp32":
        return
    if name not in ("fp16", "bf16"):
        raise _invalid(f"communication_data_type = {value!r} is not allowed; allowed: \"fp32\", "
                       '"fp16" or "bf16"')
    if name != precision and world_size > 1:
        log.warning("communication_data_type = %r: zoe reduces the gradients over the ranks in "
                    "fp32, where DeepSpeed would reduce them in %s", value, name)


def _grad_accum_dtype(document, stage, precision, accumulation):
    """data_types.grad_accum_dtype: "fp32" (torch.float32) where the micro-batches of a step add
    up in fp32 sums instead of the model's dtype (fp32 with a bf16 or fp16 model at stages 0 to
    2, over a step of several micro-batches: grad_accumulation.py), else None: the dtype they
    add up in anyway (fp32 at stage 3, in the optimizer's gradient stores; the model's dtype,
    in param.grad, at stages 0 to 2), or a step of one micro-batch. Another dtype is refused
    naming the ones allowed."""
    types = document.get("data_types")
    if types is None:
        return None
    if not isinstance(types, dict):
        raise _invalid(f"data_types = {types!r} is not allowed; allowed: an object")
    value = types.get("grad_accum_dtype")
    zoe_dtype = "fp32" if stage == 3 else precision
    if value is None or accumulation == 1 or value in _DTYPE_NAMES[zoe_dtype]:
        return None
    if value in _DTYPE_NAMES["fp32"]:
        return "fp32"
    where = ("in the optimizer's gradient stores" if stage == 3
             else "in param.grad, in the model's dtype, or in fp32")
    raise _invalid(
        f"data_types.grad_accum_dtype = {value!r} is not allowed: at zero_optimization.stage "
        f"{stage} zoe accumulates the gradients of the {accumulation} micro-batches of a step "
        f'{where}; set it to "{zoe_dtype}"' + ('' if zoe_dtype == "fp32" else ' or "fp32"')
        + ", or remove it")


def _reduce_bucket_size(zero):
    """zero_optimization.reduce_bucket_size: the elements of gradients reduced together (stages 1
    to 3 over ranks); None when absent or "auto" (zoe's default, 4 Mi); InvalidArgument naming
    the key for anything but a whole number >= 0."""
    value = zero.get("reduce_bucket_size")
    if value is None or value == AUTO:
        return None
    return whole_count(value, "zero_optimization.reduce_bucket_size",
                       "elements of gradients reduced together; 0 or 1: one parameter per bucket")


# Keys whose values may differ between the ranks: each rank's NVMe directory may be its own.
_PER_RANK_KEYS = ("nvme_path", "nvme_paths")
_ABSENT = "(absent)"


def check_same_on_every_rank(document, group):
    """InvalidArgument on every rank of ``group`` when the ranks were given different
    configurations (their NVMe paths aside), naming each key that differs and its value on
    each rank: a rank at another stage, batch size or learning rate would pair its collectives
    with the wrong ones of the others, or step its shard otherwise. A collective."""
    configs = gather_objects(_flattened(document), group, "the DeepSpeed configurations")
    keys = sorted({key for config in configs for key in config})
    differing = [key for key in keys
                 if len({config.get(key, _ABSENT) for config in configs}) > 1]
    if not differing:
        return
    shown = "; ".join(f"{key}: {by_rank([config.get(key, _ABSENT) for config in configs])}"
                      for key in differing[:4])
    more = f" (and {len(differing) - 4} more)" if len(differing) > 4 else ""
    raise _invalid(f"the ranks were given different DeepSpeed configurations: {shown}{more}. "
                   "Every rank must train with the same one (only the NVMe paths may differ)")


def _flattened(value, path=""):
    """{dotted key: the value as compact JSON} of a document's leaves, _PER_RANK_KEYS left out."""
    if not isinstance(value, dict):
        return {path: json.dumps(value, sort_keys=True)}
    flat = {}
    for key, item in value.items():
        if key not in _PER_RANK_KEYS:
            flat.update(_flattened(item, f"{path}.{key}" if path else str(key)))
    return flat


def engine_document(training, rank, world_size):
    """The configuration handed to the zoe engine of this rank: the user's, with the stage
    DeepSpeed defaults to (0) made explicit, with several ranks each rank's NVMe directory
    its own (``{rank}`` replaced, else a ``rank<r>`` directory below the path given), and with
    activation checkpoints offloaded below stage 3 automatic tensor swap."""
    document = json.loads(json.dumps(training.document))
    zero = document.setdefault("zero_optimization", {})
    zero["stage"] = training.zero_stage
    for key in ("offload_optimizer", "offload_param"):
        section = zero.get(key)
        if isinstance(section, dict) and section.get("nvme_path"):
            section["nvme_path"] = _created_nvme_path(key, section["nvme_path"], rank,
                                                      world_size)
    checkpointing = training.activation_checkpointing
    zoe_section = document.setdefault("zoe", {})
    if checkpointing is not None and checkpointing.cpu_checkpointing and \
            training.zero_stage < 3 and isinstance(zoe_section, dict):
        # The optimizer's engine, which reserves tensor swap for its device staging only
        # (config._optimizer_engine_config), takes the offloaded checkpoints too: unless the
        # config sizes it, its swap grows as they register (0: automatic).
        zoe_section.setdefault("tensor_swap_bytes", 0)
    return document


def _created_nvme_path(key, path, rank, world_size):
    """_rank_path of ``zero_optimization.<key>.nvme_path``; an error naming the key when its
    directory cannot be created: InvalidArgument where a file stands in the way, else zoe's
    error for the errno (PermissionDenied, NoSpace, ...)."""
    where = f"zero_optimization.{key}.nvme_path {path!r}"
    try:
        return _rank_path(path, rank, world_size)
    except (FileExistsError, NotADirectoryError) as error:
        raise _invalid(f"{where} is not a directory: a file stands in the way ({error}); name "
                       "a directory") from error
    except OSError as error:
        raise as_zoe_error(error, f"{where}: its directory cannot be created ({error}); name a "
                                  "writable directory") from error


def _rank_path(path, rank, world_size):
    """An NVMe path (or list of paths) made this rank's own, its directory created."""
    if isinstance(path, list):
        return [_rank_path(one, rank, world_size) for one in path]
    path = os.fspath(path)
    if "{rank}" in path:
        path = path.replace("{rank}", str(rank))
    elif world_size > 1:
        path = os.path.join(path, f"rank{rank}")
    os.makedirs(path, exist_ok=True)
    return path


def data_parallel_group(process_group):
    """The data-parallel group: the one given, else the default group when torch.distributed
    is initialized, else None (one process)."""
    if process_group is not None:
        return process_group
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return None


def read_config(config, group, caller="initialize"):
    """The training settings and this rank's engine document (its NVMe directories created)
    for the data-parallel ``group`` (None: one process), read by every rank of it before any
    builds anything (for ``caller``, as messages name it): a rank that fails (a bad value, a
    directory it cannot create) makes every rank raise naming it (agreed), and ranks given
    different configurations are refused naming the keys (check_same_on_every_rank)."""
    world = 1 if group is None else dist.get_world_size(group)
    rank = 0 if group is None else dist.get_rank(group)

    def read():
        training = training_config(config, world)
        return training, engine_document(training, rank, world)

    if group is None:
        return read()
    training, document = agreed(f"{caller}: reading the DeepSpeed configuration", read, group)
    check_same_on_every_rank(training.document, group)
    return training, document
