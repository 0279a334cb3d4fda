"""DeepSpeed reads some sections of its configuration with pydantic models (DeepSpeedConfigModel,
lax mode): zero_optimization with its offload_optimizer and offload_param, hybrid_engine and
tensor_parallel, and from 0.17.1 on fp16 and bf16. pydantic converts a value to its field's type
where it can ("false" to False, "2" to 2, "1e9" to 1e9 where a float is wanted) and refuses what
it cannot; the other keys DeepSpeed reads with get_scalar_param, which converts nothing (a quoted
"false" is a non-empty string, true for Python). ``normalize`` reads the first kind as pydantic
does, and puts zero_optimization's deprecated offload switches in the sections they stand for,
before zoe.torch.initialize reads the document. The engine does the same, with the same table
and messages, for a document given to it directly (core/engine_config_pydantic.cc)."""

import json
import math
import re

from .common import _invalid

AUTO = "auto"
BOOL, INT, FLOAT = "bool", "int", "float"
_ZERO = "zero_optimization"

# The keys zoe accepts in DeepSpeed's pydantic sections, typed as DeepSpeed's models type them
# (DeepSpeedZeroConfig, DeepSpeedZeroOffloadOptimizerConfig, DeepSpeedZeroOffloadParamConfig,
# DeepSpeedFP16Config, DeepSpeedBF16Config, HybridEngineConfig, TPTrainingConfig); an
# Optional[bool] is a bool here (None is left alone). The engine's table is the same.
TYPED_KEYS = {
    _ZERO: dict(
        stage=INT, contiguous_gradients=BOOL, reduce_scatter=BOOL, reduce_bucket_size=INT,
        use_multi_rank_bucket_allreduce=BOOL, allgather_partitions=BOOL,
        allgather_bucket_size=INT, overlap_comm=BOOL, load_from_fp32_weights=BOOL,
        elastic_checkpoint=BOOL, sub_group_size=INT, cpu_offload_param=BOOL,
        cpu_offload_use_pin_memory=BOOL, cpu_offload=BOOL, stage3_prefetch_bucket_size=INT,
        stage3_param_persistence_threshold=INT, stage3_model_persistence_threshold=INT,
        stage3_max_live_parameters=INT, stage3_max_reuse_distance=INT,
        stage3_gather_16bit_weights_on_model_save=BOOL,
        stage3_gather_fp16_weights_on_model_save=BOOL, stage3_module_granularity_threshold=INT,
        stage3_use_all_reduce_for_fetch_params=BOOL, ignore_unused_parameters=BOOL,
        legacy_stage1=BOOL, round_robin_gradients=BOOL, zero_hpz_partition_size=INT,
        zero_quantized_weights=BOOL, zero_quantized_nontrainable_weights=BOOL,
        zero_quantized_gradients=BOOL, mics_shard_size=INT, mics_hierarchical_params_gather=BOOL,
        memory_efficient_linear=BOOL, pipeline_loading_checkpoint=BOOL,
        override_module_apply=BOOL, log_trace_cache_warnings=BOOL),
    f"{_ZERO}.offload_optimizer": dict(
        buffer_count=INT, pin_memory=BOOL, pipeline_read=BOOL, pipeline_write=BOOL,
        fast_init=BOOL, ratio=FLOAT),
    f"{_ZERO}.offload_param": dict(
        buffer_count=INT, buffer_size=INT, max_in_cpu=INT, pin_memory=BOOL),
    "fp16": dict(
        enabled=BOOL, auto_cast=BOOL, loss_scale=FLOAT, initial_scale_power=INT,
        loss_scale_window=INT, hysteresis=INT, consecutive_hysteresis=BOOL,
        min_loss_scale=FLOAT, fp16_master_weights_and_grads=BOOL),
    "bf16": dict(enabled=BOOL, immediate_grad_update=BOOL),
    "hybrid_engine": dict(
        enabled=BOOL, max_out_tokens=INT, inference_tp_size=INT, release_inference_cache=BOOL,
        pin_parameters=BOOL, tp_gather_partition_size=INT, enable_cuda_graph=BOOL),
    "tensor_parallel": dict(
        autotp_size=INT, keep_module_on_host=BOOL, replace_with_kernel_inject=BOOL,
        kernel_inject=BOOL),
}
# Megatron-DeepSpeed writes bf16 as bfloat16.
_SPELLINGS = {"bf16": ("bf16", "bfloat16")}

# pydantic's words for a bool, compared in lower case.
_BOOL_WORDS = {"0": False, "off": False, "f": False, "false": False, "n": False, "no": False,
               "1": True, "on": True, "t": True, "true": True, "y": True, "yes": True}
_SPACE = " \t\n\r\f\v"
_DIGITS = r"[0-9]+(?:_[0-9]+)*"  # single underscores between digits, as Python writes numbers
# pydantic's lax int: [sign] digits [. zeros]; its lax float: Python's float() grammar.
_INT_TEXT = re.compile(rf"([+-]?{_DIGITS})(?:\.0+)?")
_FLOAT_TEXT = re.compile(
    rf"[+-]?(?:(?:{_DIGITS}(?:\.(?:{_DIGITS})?)?|\.{_DIGITS})(?:[eE][+-]?{_DIGITS})?"
    r"|inf|infinity|nan)", re.IGNORECASE)
_ALLOWED = {
    BOOL: 'true or false (DeepSpeed\'s pydantic also takes 0 and 1, and "true", "false", "yes", '
          '"no", "on", "off", "t", "f", "y", "n", "1" or "0" in any letter case)',
    INT: 'an integer (DeepSpeed\'s pydantic also takes one quoted, such as "2" or "2.0", but not '
         '"1e9" or "2.5")',
    FLOAT: 'a number (DeepSpeed\'s pydantic also takes one quoted, such as "0.5" or "1e9")',
}
_REFUSED = object()

# zero_optimization's deprecated offload switches and the sections they stand for.
_DEPRECATED_OFFLOADS = (("cpu_offload", "offload_optimizer"),
                        ("cpu_offload_param", "offload_param"))


def normalize(document):
    """``document`` (a dict) read as DeepSpeed's pydantic models read it, in place: the values of
    TYPED_KEYS converted as pydantic's lax mode converts them (numbers where an int or a float
    is wanted, None and "auto" left for zoe's readers), then cpu_offload and cpu_offload_param
    replaced by offload_optimizer and offload_param ({"device": "cpu"} when true, "none" when
    false or None; "auto" removed). InvalidArgument naming the key and the value for what
    DeepSpeed refuses: a value pydantic cannot convert, a deprecated switch given with its
    section, cpu_offload_params (DeepSpeed's spelling before 0.7). Returns ``document``."""
    for section, keys in TYPED_KEYS.items():
        for key, kind in keys.items():
            for spelling in _SPELLINGS.get(section, (section,)):
                holder = _object_at(document, spelling)
                if holder is not None and key in holder:
                    holder[key] = _coerce(f"{spelling}.{key}", kind, holder[key])
    _map_deprecated_offloads(document)
    return document


def describe(value):
    """A value as the engine's messages show it: compact JSON, an object as "an object"."""
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(describe(item) for item in value) + "]"
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity"
    return json.dumps(value, ensure_ascii=False)


def _object_at(document, path):
    """The dict at a dotted path, or None when a section on the way is absent or no dict."""
    node = document
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node if isinstance(node, dict) else None


def _coerce(path, kind, value):
    if value is None or (isinstance(value, str) and value == AUTO):
        return value
    converted = _as_bool(value) if kind == BOOL else _as_number(value, kind)
    if converted is _REFUSED:
        hint = '; did you mean "auto"?' if isinstance(value, str) and _near_auto(value) else ""
        raise _invalid(f"{path} = {describe(value)} is not allowed; allowed: {_ALLOWED[kind]}"
                       f"{hint}")
    return converted


def _as_bool(value):
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return bool(value) if value in (0, 1) else _REFUSED
    if isinstance(value, str):
        return _BOOL_WORDS.get(value.lower(), _REFUSED)
    return _REFUSED


def _as_number(value, kind):
    if isinstance(value, (bool, int, float)):
        return value  # zoe's reader of the key checks it
    if not isinstance(value, str):
        return _REFUSED
    text = value.strip(_SPACE)
    if kind == INT:
        match = _INT_TEXT.fullmatch(text)
        return int(match.group(1)) if match else _REFUSED
    return float(text) if _FLOAT_TEXT.fullmatch(text) else _REFUSED


def _near_auto(text):
    """Whether ``text`` looks like a typo of "auto", as the engine's ClosestMatch finds one."""
    name = text.lower()
    contains = len(name) >= 3 and (name in AUTO or AUTO in name)
    return contains or _edit_distance(name, AUTO) <= max(2, len(name) // 3)


def _edit_distance(a, b):
    row = list(range(len(b) + 1))
    for i, char_a in enumerate(a, 1):
        diagonal, row[0] = row[0], i
        for j, char_b in enumerate(b, 1):
            diagonal, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1,
                                           diagonal + (char_a != char_b))
    return row[-1]


def _map_deprecated_offloads(document):
    zero = _object_at(document, _ZERO)
    if zero is None:
        return
    if "cpu_offload_params" in zero:
        raise _invalid(
            f"zero_optimization.cpu_offload_params = {describe(zero['cpu_offload_params'])} is "
            "DeepSpeed's spelling before 0.7, which later releases refuse as an unknown key; for "
            'true write "offload_param": {"device": "cpu"}, for false remove it')
    for key, section in _DEPRECATED_OFFLOADS:
        if key not in zero:
            continue
        value = zero.pop(key)
        if isinstance(value, str) and value == AUTO:
            continue  # DeepSpeed's models drop "auto" values
        if section in zero:
            raise _invalid(
                f"zero_optimization.{key} and zero_optimization.{section} are both given; {key} "
                f"is DeepSpeed's deprecated spelling of {section}, and DeepSpeed refuses the two "
                f"together: keep {section}")
        zero[section] = {"device": "cpu" if value is True else "none"}
