"""The configuration of the engine a zoe optimizer creates (engine_config and the optimizer's
arguments checked against a DeepSpeed-shaped configuration) and the param group options zoe's
step takes."""

import json
import math
import numbers
import os

import torch

from ..engine import _config_text
from .common import _invalid
from .optim_kinds import ALL_HYPER_KEYS


def engine_config(offload="cpu", nvme_path=None, moment_dtype=None, **zoe_options):
    """A configuration dict placing the optimizer state on ``offload`` ("cpu" or "nvme")."""
    if offload not in ("cpu", "nvme"):
        raise _invalid(f"offload = {offload!r} is not allowed; allowed: 'cpu', 'nvme'")
    if offload == "cpu" and nvme_path:
        raise _invalid(
            f"nvme_path = {os.fspath(nvme_path)!r} with offload='cpu': the state would stay in "
            "DRAM and the path go unused; give offload='nvme' (or no offload: a path implies it)"
        )
    section = {"device": offload}
    if offload == "nvme":
        if not nvme_path:
            raise _invalid("offload='nvme' needs nvme_path, a directory for the swap files")
        section["nvme_path"] = os.fspath(nvme_path)
    options = dict(zoe_options)
    if moment_dtype:
        options["moment_dtype"] = moment_dtype
    # This engine holds optimizer groups only: no swap space for registered tensors is needed.
    options.setdefault("tensor_swap_bytes", "1M")
    return {"zero_optimization": {"offload_optimizer": section}, "zoe": options}


def _optimizer_engine_config(config, offload, nvme_path, arguments, swap_bytes):
    """The configuration of the engine an optimizer creates: ``config`` (a DeepSpeed-shaped
    dict, JSON string or file path; its "auto" values are decided by the optimizer's arguments)
    when given, else one from ``offload`` (None: "nvme" with an nvme_path, else "cpu") and the
    moment dtype among ``arguments`` (see _check_config_agrees). The engine holds optimizer
    groups only, so unless the config says otherwise it reserves for registered tensors only the
    ``swap_bytes`` its device groups' staging needs (0: none). An argument that contradicts a
    value the config sets is refused."""
    swap = swap_bytes or "1M"
    if config is None:
        offload = offload or ("nvme" if nvme_path else "cpu")
        moment_dtype, _ = arguments["zoe.moment_dtype"]
        return engine_config(offload, nvme_path, moment_dtype=moment_dtype,
                             tensor_swap_bytes=swap)
    if nvme_path is not None or offload is not None:
        raise _invalid(
            "give either config (its zero_optimization.offload_optimizer places the state) or "
            "offload/nvme_path, not both"
        )
    document = json.loads(_config_text(config) or "{}")
    _check_config_agrees(document, arguments)
    zoe_section = document.setdefault("zoe", {})
    if isinstance(zoe_section, dict):
        zoe_section.setdefault("tensor_swap_bytes", swap)  # a value the config sets is kept
    return document


def _check_config_agrees(document, arguments):
    """InvalidArgument when the config sets a value (other than "auto") that an optimizer
    argument contradicts. ``arguments`` maps a config key ("zoe.moment_dtype",
    "gradient_clipping", "optimizer.params.lr", ...) to the optimizer's argument and its name;
    an argument None stands for "not given". Either place alone decides; neither silently
    overrides the other."""
    for key, (argument, name) in arguments.items():
        configured = document
        for part in key.split("."):
            configured = configured.get(part) if isinstance(configured, dict) else None
        if configured is None or configured == "auto" or argument is None:
            continue
        if not _agree(configured, argument):
            given = "" if key in _GIVEN_ONLY else " (passed, or the optimizer's default)"
            raise _invalid(
                f"{name} = {argument!r}{given} contradicts the config's {key} = {configured!r}; "
                'set it in one place (or write "auto" in the config: it then takes the argument)'
            )


def _check_type_agrees(document, engine, zoe_type):
    """InvalidArgument when the config names an optimizer.type that zoe (which reads DeepSpeed's
    "Adam" as AdamW unless adam_w_mode is false) resolves to another kind than the class
    constructed."""
    optimizer = document.get("optimizer")
    if not isinstance(optimizer, dict) or optimizer.get("type") is None:
        return
    resolved = engine.config["optimizer"]["type"]
    if resolved != zoe_type.lower():
        raise _invalid(
            f"zoe.torch.{zoe_type} contradicts the config's optimizer.type = "
            f"{optimizer['type']!r} (read as {resolved!r}); construct the matching class or "
            "change the config"
        )


# Param group keys torch's optimizers would act on, which zoe's step does not do when true.
_UNSUPPORTED_FLAGS = ("amsgrad", "maximize", "capturable", "differentiable")
# Keys of the optimizer's own, which a param group cannot set.
_OPTIMIZER_WIDE = ("moment_dtype", "max_grad_norm")


def _check_group_options(group, where, kind):
    """InvalidArgument for a param group (added, loaded from a state dict, or changed before a
    step) that asks for something the step of ``kind`` (optim_kinds.OptimizerKind) would not
    do."""
    for key in _UNSUPPORTED_FLAGS:
        if group.get(key):
            raise _invalid(f"{where} sets {key} = {group[key]!r}; zoe optimizers support none of "
                           f"{', '.join(_UNSUPPORTED_FLAGS)}")
    foreign = sorted((ALL_HYPER_KEYS - set(kind.hyper_keys)) & set(group))
    if foreign:
        raise _invalid(f"{where} sets {foreign[0]!r}, which zoe.torch.{kind.name} does not take "
                       "(another optimizer's setting)")
    if group.get("initial_accumulator_value"):
        raise _invalid(f"{where} sets initial_accumulator_value = "
                       f"{group['initial_accumulator_value']!r}; zoe's Adagrad starts its sums "
                       "at 0 (as DeepSpeed's CPU Adagrad does): leave it 0")
    decoupled = group.get("decoupled_weight_decay")  # torch >= 2.7: Adam's switch to AdamW
    if decoupled is not None and kind.decoupled is not None and bool(decoupled) != kind.decoupled:
        named = "AdamW" if decoupled else "Adam"
        raise _invalid(f"{where} sets decoupled_weight_decay = {decoupled!r}, which is "
                       f"{named}; this optimizer is zoe.torch.{kind.name}")
    for key in _OPTIMIZER_WIDE:
        if key in group:
            raise _invalid(f"{where} sets {key!r}; it is the optimizer's, given to its "
                           "constructor (or the engine configuration), not per param group")


# Config keys whose optimizer argument is compared only when the caller passed it.
_GIVEN_ONLY = ("zoe.moment_dtype", "gradient_clipping")


def _agree(configured, argument):
    """Whether a config value and an argument say the same: numbers (any real, numpy's
    included) equal to a relative 1e-6, so that a value computed in code or held in float32
    (rounded to 6e-8) agrees with the config's decimal; sequences element by element; anything
    else by ==."""
    if isinstance(configured, (list, tuple)) and isinstance(argument, (list, tuple)):
        return len(configured) == len(argument) and all(
            _agree(a, b) for a, b in zip(configured, argument)
        )
    numeric = (numbers.Real, torch.Tensor)
    if (isinstance(configured, numbers.Real) and isinstance(argument, numeric)
            and not isinstance(configured, bool) and not isinstance(argument, bool)):
        return math.isclose(float(configured), float(argument), rel_tol=1e-6, abs_tol=0.0)
    return configured == argument
