"""The sections DeepSpeed reads with pydantic, read as pydantic reads them by zoe.torch.initialize
and by the engine alike (quoted booleans and numbers converted, what pydantic refuses refused
with the same message by both, "auto" and the get_scalar_param keys left alone); fp16 switches
under fp16.enabled "auto"; the deprecated offload switches; load_from_fp32_weights; and the
precision keys communication_data_type and data_types.grad_accum_dtype."""

import copy
import math

import pytest

import zoe
import zoe.torch
from initialize_script import ds_config, make_model, train_engine
from zoe.engine import normalize_deepspeed_config as normalize
from zoe.torch.ds_config import training_config

BOOL, INT, FLOAT = "bool", "int", "float"
_ZERO = "zero_optimization"

# The keys of DeepSpeed's pydantic sections that zoe accepts, typed as DeepSpeed's models type
# them (DeepSpeedZeroConfig, DeepSpeedZeroOffloadOptimizerConfig, DeepSpeedZeroOffloadParamConfig,
# DeepSpeedFP16Config, DeepSpeedBF16Config, HybridEngineConfig, TPTrainingConfig); an
# Optional[bool] is a bool here (None is left alone).
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


def initialize(config):
    engine, _, _, _ = zoe.torch.initialize(model=make_model(), config=config)
    return engine


def refused(config, match):
    with pytest.raises(zoe.InvalidArgument, match=match):
        initialize(config).close()


def nested(path, value):
    """{"a": {"b": value}} for the path "a.b"."""
    for part in reversed(path.split(".")):
        value = {part: value}
    return value


def engine_error(document):
    with pytest.raises(zoe.InvalidArgument) as error:
        zoe.Engine(document).close()
    return str(error.value)


# ---------------------------------------------------------------------------------------------
# Quoted values

@pytest.mark.parametrize("section,key,kind", [
    (section, key, kind) for section, keys in TYPED_KEYS.items() for key, kind in keys.items()])
def test_the_engine_refuses_what_pydantic_refuses_with_the_message_initialize_gives(section, key,
                                                                                    kind):
    """Every key DeepSpeed's models type is read as its type by the reader initialize and the
    engine share."""
    bad = {BOOL: "maybe", INT: "2.5"}.get(kind, "half")
    with pytest.raises(zoe.InvalidArgument) as error:
        normalize(nested(f"{section}.{key}", bad))
    message = str(error.value)
    assert f'{section}.{key} = "{bad}" is not allowed; allowed: ' in message
    assert message in engine_error(nested(f"{section}.{key}", bad))
    if key in ("cpu_offload", "cpu_offload_param"):
        return  # converted, then replaced by their sections (below)
    good = {BOOL: "Yes", INT: " +1_0.00 "}.get(kind, "1e1")
    assert normalize(nested(f"{section}.{key}", good)) == nested(f"{section}.{key}",
                                                                 {BOOL: True}.get(kind, 10))


def test_the_rest_of_the_document_comes_back_as_given_non_finite_numbers_included():
    document = {"steps_per_print": math.inf, "wandb": {"project": "NaN"}, "amp": {"enabled": "no"},
                "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": [0.9, 0.99]}},
                "zero_optimization": {"stage": "auto", "reduce_bucket_size": -math.inf,
                                      "sub_group_size": " 1_000 ", "overlap_comm": None},
                "fp16": {"enabled": "auto", "loss_scale": "inf"}, "gradient_clipping": "1.0"}
    given = copy.deepcopy(document)
    normalized = normalize(document)
    assert document == given  # a fresh dict
    assert normalized.pop("fp16") == {"enabled": "auto", "loss_scale": math.inf}
    assert normalized.pop("zero_optimization") == {"stage": "auto", "reduce_bucket_size": -math.inf,
                                                   "sub_group_size": 1000, "overlap_comm": None}
    del given["fp16"], given["zero_optimization"]
    assert normalized == given
    assert normalize({}) == {}


def test_the_document_keeps_its_order_and_its_integers():
    document = {"train_batch_size": 8, "zero_optimization": {"stage": "2", "cpu_offload": True,
                                                             "overlap_comm": "no"},
                "seed": 2**70, "fp16": {"enabled": False}, "amp": {"opt_level": "O1"}}
    normalized = normalize(document)
    assert list(normalized) == list(document)
    assert list(normalized["zero_optimization"]) == ["stage", "overlap_comm", "offload_optimizer"]
    assert normalized["seed"] == 2**70 and isinstance(normalized["seed"], int)


def test_quoted_values_of_pydantic_sections_train_as_deepspeed_reads_them():
    config = ds_config(stage=1, offload="cpu")
    config["zero_optimization"].update(stage="1", zero_quantized_weights="false",
                                       zero_quantized_gradients="No", overlap_comm=1,
                                       sub_group_size="64", reduce_bucket_size="1000")
    config["hybrid_engine"] = {"enabled": "false", "max_out_tokens": "512"}
    config["tensor_parallel"] = {"autotp_size": "1"}
    training = training_config(config, 1)
    assert training.zero_stage == 1
    assert training.reduce_bucket_size == 1000
    engine = initialize(config)
    train_engine(engine, 0, 1, 0, 1)
    assert engine.global_steps == 1
    assert engine.zero_optimization_stage() == 1
    engine.close()


def test_quoted_fp16_settings_are_converted():
    fp16 = training_config({"train_batch_size": 1, "zero_optimization": {"stage": 1}, "fp16": {
        "enabled": "true", "loss_scale_window": "500", "hysteresis": "1",
        "consecutive_hysteresis": "on", "min_loss_scale": "0.5", "loss_scale": "0"}}, 1).fp16
    assert fp16 == dict(loss_scale=0.0, initial_scale_power=16, loss_scale_window=500,
                        hysteresis=1, consecutive_hysteresis=True, min_loss_scale=0.5,
                        growth_delay=0)
    assert training_config({"train_batch_size": 1, "bfloat16": {"enabled": "y"}}, 1).bf16
    assert training_config({"train_batch_size": 1, "fp16": {"enabled": "0"}}, 1).fp16 is None


@pytest.mark.parametrize("section,match", [
    ({"tensor_parallel": {"autotp_size": "2"}},
     "tensor_parallel.autotp_size = 2: with it DeepSpeed splits the model's layers"),
    ({"zero_optimization": {"stage": 0, "zero_quantized_weights": "true"}},
     "zero_optimization.zero_quantized_weights = true: with it DeepSpeed all-gathers"),
    ({"zero_optimization": {"stage": 0, "overlap_comm": "sometimes"}},
     'zero_optimization.overlap_comm = "sometimes" is not allowed; allowed: true or false'),
    ({"zero_optimization": {"stage": "1e0"}},
     'zero_optimization.stage = "1e0" is not allowed; allowed: an integer'),
    ({"fp16": {"enabled": "atuo"}}, 'fp16.enabled = "atuo" is not allowed; allowed: true or '
                                    'false .*; did you mean "auto"\\?'),
    # get_scalar_param keys convert nothing: a quoted "false" is true for Python there.
    ({"amp": {"enabled": "false"}}, 'amp.enabled = "false": with it DeepSpeed trains'),
])
def test_quoted_values_are_checked_as_deepspeed_reads_them(section, match):
    config = ds_config()
    config.update(section)
    refused(config, match)


def test_auto_stays_auto():
    config = ds_config(stage=1, offload="cpu")
    config["zero_optimization"].update(reduce_bucket_size="auto",
                                       stage3_prefetch_bucket_size="auto", overlap_comm=None)
    config["fp16"] = {"enabled": "auto", "loss_scale_window": "1000"}
    training = training_config(config, 1)
    assert training.reduce_bucket_size is None
    assert training.fp16 is None
    assert training.document["fp16"]["enabled"] == "auto"
    initialize(config).close()


# ---------------------------------------------------------------------------------------------
# fp16 switches under fp16.enabled "auto"

@pytest.mark.parametrize("key", ["auto_cast", "fp16_master_weights_and_grads"])
def test_fp16_switches_are_refused_when_fp16_enabled_is_auto(key):
    config = ds_config()
    config["fp16"] = {"enabled": "auto", key: True}
    refused(config, f'fp16.{key} = true with fp16.enabled = "auto" \\(DeepSpeed reads the '
                    'switch whatever "auto" becomes\\): with it DeepSpeed')
    config["fp16"][key] = False
    initialize(config).close()


# ---------------------------------------------------------------------------------------------
# Deprecated offload switches, load_from_fp32_weights

def test_cpu_offload_offloads_the_optimizer_as_offload_optimizer_does():
    config = ds_config(stage=2)
    del config["zero_optimization"]["offload_optimizer"]
    config["zero_optimization"]["cpu_offload"] = "true"
    training = training_config(config, 1)
    assert training.offload_optimizer == "cpu"
    assert training.document["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}
    engine = initialize(config)
    assert engine.zero_cpu_offload()
    train_engine(engine, 0, 1, 0, 1)
    engine.close()
    config["zero_optimization"]["cpu_offload"] = False
    assert training_config(config, 1).offload_optimizer == "none"


@pytest.mark.parametrize("zero,match", [
    ({"cpu_offload": False, "offload_optimizer": {"device": "cpu"}},
     "zero_optimization.cpu_offload and zero_optimization.offload_optimizer are both given; "
     "cpu_offload is DeepSpeed's deprecated spelling of offload_optimizer"),
    ({"cpu_offload_param": True, "offload_param": {"device": "cpu"}},
     "zero_optimization.cpu_offload_param and zero_optimization.offload_param are both given"),
    ({"cpu_offload_params": True},
     "zero_optimization.cpu_offload_params = true is DeepSpeed's spelling before 0.7, which later "
     'releases refuse as an unknown key; for true write "offload_param": {"device": "cpu"}, for '
     "false remove it"),
])
def test_deprecated_offload_switches_are_refused_where_deepspeed_refuses_them(zero, match):
    document = {"zero_optimization": zero}
    with pytest.raises(zoe.InvalidArgument) as error:
        training_config(dict(document, train_batch_size=1), 1)
    assert match in str(error.value)
    assert match in engine_error(document)


def test_load_from_fp32_weights_false_is_refused_with_16_bit_weights_at_stages_1_and_2():
    config = ds_config(stage=1, offload="cpu")
    config["bf16"] = {"enabled": True}
    config["zero_optimization"]["load_from_fp32_weights"] = "false"
    refused(config, "zero_optimization.load_from_fp32_weights = false: with it DeepSpeed's ZeRO "
                    "stage 1 load takes the fp32 master weights from the model's bf16 weights")
    config["zero_optimization"]["load_from_fp32_weights"] = True
    initialize(config).close()
    del config["bf16"]  # an fp32 model loads the same weights either way
    config["zero_optimization"]["load_from_fp32_weights"] = False
    initialize(config).close()
    # DeepSpeed's stage 3 load does not read it.
    with zoe.Engine({"zero_optimization": {"stage": 3, "load_from_fp32_weights": False},
                     "bf16": {"enabled": True},
                     "zoe": {"device": "host", "tensor_swap_bytes": "4M"}}):
        pass


# ---------------------------------------------------------------------------------------------
# communication_data_type, data_types.grad_accum_dtype

@pytest.mark.parametrize("value", [None, "fp32", "FP32", "bf16", "fp16"])
def test_communication_data_types_deepspeed_takes_are_accepted(value):
    config = ds_config(stage=1, offload="cpu")
    config["communication_data_type"] = value
    engine = initialize(config)
    engine.close()


def test_communication_in_16_bits_other_than_the_models_logs_fp32_over_ranks(caplog):
    config = ds_config()
    config["communication_data_type"] = "FP16"
    training_config(config, 1)  # nothing reduced: nothing to say
    assert "reduces the gradients" not in caplog.text
    config = ds_config(world=2)
    config["communication_data_type"] = "FP16"
    training_config(config, 2)
    assert "communication_data_type = 'FP16': zoe reduces the gradients over the ranks in " \
        "fp32, where DeepSpeed would reduce them in fp16" in caplog.text
    config["bf16"] = {"enabled": True}
    config["communication_data_type"] = "bf16"  # the model's dtype: DeepSpeed's default
    caplog.clear()
    training_config(config, 2)
    assert "reduces the gradients" not in caplog.text


def test_communication_data_type_deepspeed_refuses_is_refused():
    config = ds_config()
    config["communication_data_type"] = "fp64"
    with pytest.raises(zoe.InvalidArgument, match="communication_data_type = 'fp64' is not "
                                                  'allowed; allowed: "fp32", "fp16" or "bf16"'):
        training_config(config, 1)


@pytest.mark.parametrize("stage,precision,value,accumulates_in", [
    (0, None, "fp32", None), (2, None, "float", None), (1, "bf16", "bf16", None),
    (2, "fp16", "torch.float16", None), (3, "bf16", "fp32", None), (3, None, "float32", None),
    (1, "bf16", "fp32", "fp32"), (0, "fp16", "float", "fp32"),
    (2, "bf16", "torch.float32", "fp32")])
def test_grad_accum_dtype_is_accepted_where_zoe_accumulates_in_it(stage, precision, value,
                                                                 accumulates_in):
    """Where zoe accumulates in that dtype anyway (None), or in the fp32 sums of a 16-bit
    model's micro-batches at stages 0 to 2 ("fp32")."""
    config = ds_config(stage=stage)
    if precision is not None:
        config[precision] = {"enabled": True}
    config["data_types"] = {"grad_accum_dtype": value}
    assert training_config(config, 1).grad_accum_dtype == accumulates_in


@pytest.mark.parametrize("stage,precision,value,match", [
    (1, "bf16", "fp16",
     "data_types.grad_accum_dtype = 'fp16' is not allowed: at zero_optimization.stage 1 zoe "
     "accumulates the gradients of the 2 micro-batches of a step in param.grad, in the model's "
     'dtype, or in fp32; set it to "bf16" or "fp32", or remove it'),
    (3, "fp16", "fp16", "at zero_optimization.stage 3 zoe accumulates the gradients of the 2 "
                        "micro-batches of a step in the optimizer's gradient stores; set it to "
                        '"fp32", or remove it'),
    (0, None, "int8", "data_types.grad_accum_dtype = 'int8' is not allowed"),
])
def test_grad_accum_dtype_is_refused_where_zoe_accumulates_in_another(stage, precision, value,
                                                                      match):
    config = ds_config(stage=stage)
    if precision is not None:
        config[precision] = {"enabled": True}
    config["data_types"] = {"grad_accum_dtype": value}
    with pytest.raises(zoe.InvalidArgument) as error:
        training_config(config, 1)
    assert match in str(error.value)
    # With one micro-batch per step there is nothing to accumulate.
    config["gradient_accumulation_steps"] = 1
    config["train_batch_size"] = config["train_micro_batch_size_per_gpu"]
    training_config(config, 1)


def test_precision_keys_are_the_frameworks_for_the_engine():
    with zoe.Engine({"communication_data_type": "fp32", "data_types": {"grad_accum_dtype": "bf16"},
                     "zoe": {"device": "host", "tensor_swap_bytes": "4M"}}) as engine:
        assert engine.config["zero_optimization"]["stage"] == 3
