"""The optimizers zoe.torch steps, each described once by an OptimizerKind: the type zoe's engine
steps (the C API's "type"), the param group keys its step reads, and the moments it keeps under
torch's state names. optimizer.py steps every kind the same way; state_layout.py, zero.py and
consolidate.py lay out the state by ``moments``; ds_config.py maps DeepSpeed's optimizer
sections onto the kinds.

Moments by kind (zoe's slot in brackets): AdamW and Adam 'exp_avg' (EXP_AVG) and 'exp_avg_sq'
(EXP_AVG_SQ), as torch.optim.Adam/AdamW; Adagrad 'sum' (EXP_AVG_SQ), as torch.optim.Adagrad;
Lion 'exp_avg' (EXP_AVG), as the Lion implementations for torch name it."""

import dataclasses
import math
from typing import Optional, Tuple

from .._capi import StateSlot
from ..engine import HyperParams
from .common import _invalid

_ADAM_MOMENTS = (("exp_avg", StateSlot.EXP_AVG), ("exp_avg_sq", StateSlot.EXP_AVG_SQ))
MASTER = ("master_param", StateSlot.MASTER)


@dataclasses.dataclass(frozen=True)
class OptimizerKind:
    """One optimizer zoe.torch steps (see the module docstring)."""

    name: str  # zoe's type, and the zoe.torch class's name
    moments: Tuple[Tuple[str, StateSlot], ...]  # (torch's state key, zoe slot) per moment
    hyper_keys: Tuple[str, ...]  # the param group keys its step reads, in torch's names
    # the keys among them fixed when zoe creates the group (a later change is refused)
    creation_keys: Tuple[str, ...] = ()
    # AdamW True, Adam False: what torch >= 2.7's decoupled_weight_decay must say; None: no such
    # key
    decoupled: Optional[bool] = None
    # whether torch keeps state for every parameter from construction (step 0, zero moments;
    # Adagrad's step needs it), rather than from the parameter's first step
    state_from_start: bool = False

    def slots(self, with_master):
        """(torch's key, zoe slot) of the moments, and of the fp32 master when asked."""
        return self.moments + ((MASTER,) if with_master else ())

    def hyper(self, group):
        """The HyperParams of a step of ``group`` (a param group dict) as it is now; what the
        kind does not read keeps zoe's default."""
        values = dict(lr=float(group["lr"]), weight_decay=float(group["weight_decay"]))
        if "betas" in self.hyper_keys:
            values["beta1"], values["beta2"] = (float(beta) for beta in group["betas"])
        if "eps" in self.hyper_keys:
            values["eps"] = float(group["eps"])
        return HyperParams(**values)

    def group_options(self, group):
        """The zoe group options (type and hyper-parameters) of ``group`` as it is now."""
        options = {key: group[key] for key in self.hyper_keys}
        if "betas" in options:
            options["betas"] = [float(beta) for beta in options["betas"]]
        options["lr"] = float(options["lr"])
        return dict(type=self.name, **options)

    def creation_values(self, group):
        """The values of ``group``'s creation keys, to compare with the group's later."""
        return tuple(group[key] for key in self.creation_keys)

    def changed_creation_values(self, fixed, group):
        """[(key, the value in ``fixed``, ``group``'s)] for each creation key ``group`` (a param
        group, or one a state dict or checkpoint holds) sets otherwise than ``fixed``
        (creation_values of the group as zoe created it)."""
        return [(key, value, group[key]) for key, value in zip(self.creation_keys, fixed)
                if key in group and group[key] != value]

    def normalized(self, group):
        """``group`` (hyper-parameters read back from JSON) with betas a tuple again."""
        if "betas" in group:
            group["betas"] = tuple(group["betas"])
        return group

    def check(self, hyper):
        """torch's ValueErrors for hyper-parameters (keys of hyper_keys) out of range, after
        InvalidArgument (a ValueError too) for one that is no finite number (finite_number)."""
        for key, value in hyper.items():
            if key == "betas":
                if isinstance(value, (str, bytes)) or len(value) != 2:
                    raise _invalid(f"betas = {value!r} is not allowed; allowed: two finite "
                                   "numbers (beta1, beta2)")
                for index, beta in enumerate(value):
                    finite_number(beta, f"betas[{index}]")
            else:
                finite_number(value, key)
        if not 0.0 <= hyper["lr"]:
            raise ValueError(f"Invalid learning rate: {hyper['lr']}")
        if "eps" in hyper and not 0.0 <= hyper["eps"]:
            raise ValueError(f"Invalid epsilon value: {hyper['eps']}")
        for index, beta in enumerate(hyper.get("betas", ())):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"Invalid beta parameter at index {index}: {beta}")
        if not 0.0 <= hyper["weight_decay"]:
            raise ValueError(f"Invalid weight_decay value: {hyper['weight_decay']}")
        if "lr_decay" in hyper and not 0.0 <= hyper["lr_decay"]:
            raise ValueError(f"Invalid lr_decay value: {hyper['lr_decay']}")


def finite_number(value, key):
    """``value`` of the hyper-parameter or setting ``key`` as a float: a finite number (a 0-d
    tensor too); InvalidArgument naming the key and the type wanted for anything else (a string
    such as "1e-3", true or false, null, inf, nan)."""
    number = None
    if not isinstance(value, (str, bytes, bool)) and value is not None:
        try:
            number = float(value)
        except (TypeError, ValueError):
            pass
    if number is not None and math.isfinite(number):
        return number
    if isinstance(value, str):
        raise _invalid(f"{key} = {value!r} is a string; allowed: a finite number, written "
                       "without quotes")
    raise _invalid(f"{key} = {value!r} is not allowed; allowed: a finite number")


ADAMW = OptimizerKind("AdamW", _ADAM_MOMENTS, ("lr", "betas", "eps", "weight_decay"),
                      decoupled=True)
ADAM = OptimizerKind("Adam", _ADAM_MOMENTS, ("lr", "betas", "eps", "weight_decay"),
                     decoupled=False)
ADAGRAD = OptimizerKind("Adagrad", (("sum", StateSlot.EXP_AVG_SQ),),
                        ("lr", "lr_decay", "eps", "weight_decay"), creation_keys=("lr_decay",),
                        state_from_start=True)
LION = OptimizerKind("Lion", (("exp_avg", StateSlot.EXP_AVG),), ("lr", "betas", "weight_decay"))

KINDS = {kind.name: kind for kind in (ADAMW, ADAM, ADAGRAD, LION)}
# Every kind's hyper-parameter keys: a param group holding one its optimizer's kind does not read
# is another optimizer's.
ALL_HYPER_KEYS = frozenset(key for kind in KINDS.values() for key in kind.hyper_keys)


def kind_named(name):
    """The kind zoe calls ``name`` in any case ("adamw" as an engine's checkpoint writes it);
    None for a name no kind has."""
    for kind in KINDS.values():
        if kind.name.lower() == str(name).lower():
            return kind
    return None
