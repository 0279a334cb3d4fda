"""zoe on a CUDA model through the two front doors users come by (run where torch sees a GPU;
skipped elsewhere, so CI never needs one; scripts/gpu-kit.sh bundles and runs it):

- Hugging Face's `transformers.Trainer` training a tiny GPT-2 built from a `GPT2Config`
  (nothing downloaded) with `optimizers=(zoe.torch.AdamW(..., offload="nvme"), scheduler)`,
  beside the same Trainer with torch's AdamW: the losses agree and fall;
- `zoe.torch.initialize` on a CUDA model from a DeepSpeed configuration (ZeRO stage 2 with the
  optimizer state on NVMe, AdamW and Adagrad, speculative or not, and stage 3 with the
  parameters paged through the GPU's device tier and their gradients streamed to the host;
  WarmupLR, gradient accumulation 2, clipping 1.0) beside the plain torch loop;
- ``zoe.torch.zero_init`` then ``zoe.torch.initialize`` from one configuration, the model built
  on the GPU inside the context (paged as built, never whole), beside the model built whole.
"""

import pytest
import torch

import zoe.torch
from zoe.torch.lr_schedules import WarmupLR

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device visible to torch"
)

VOCAB, SEQUENCE, SAMPLES = 128, 32, 64


class TokenDataset(torch.utils.data.Dataset):
    """Sequences that count up from a random start (mod VOCAB), each its own label: the next
    token is the current one plus one, which a causal LM learns within a few steps."""

    def __init__(self):
        generator = torch.Generator().manual_seed(0)
        starts = torch.randint(0, VOCAB, (SAMPLES, 1), generator=generator)
        self.tokens = (starts + torch.arange(SEQUENCE)) % VOCAB

    def __len__(self):
        return SAMPLES

    def __getitem__(self, index):
        return {"input_ids": self.tokens[index], "labels": self.tokens[index]}


def tiny_gpt2(transformers):
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQUENCE, n_embd=64,
                                     n_layer=2, n_head=2)
    return transformers.GPT2LMHeadModel(config).cuda()


def trainer_losses(transformers, tmp_path, name, make_optimizer):
    """The per-step training losses of a Trainer run of 12 steps with ``make_optimizer``."""
    model = tiny_gpt2(transformers)
    optimizer = make_optimizer(model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / name), per_device_train_batch_size=4, max_steps=12,
        learning_rate=1e-3, logging_steps=1, report_to="none", save_strategy="no", seed=0,
        dataloader_num_workers=0)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=TokenDataset(),
                                   optimizers=(optimizer, scheduler))
    trainer.train()
    if hasattr(optimizer, "close"):
        optimizer.close()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def test_hugging_face_trainer_trains_with_zoe_adamw_on_nvme(tmp_path):
    transformers = pytest.importorskip("transformers")
    nvme = tmp_path / "nvme"
    zoe_losses = trainer_losses(
        transformers, tmp_path, "zoe",
        lambda model: zoe.torch.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0,
                                      offload="nvme", nvme_path=str(nvme)))
    torch_losses = trainer_losses(
        transformers, tmp_path, "torch",
        lambda model: torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0))
    print("zoe", zoe_losses, "torch", torch_losses)
    assert len(zoe_losses) == len(torch_losses) == 12
    assert zoe_losses[-1] < zoe_losses[0]
    for step, (a, b) in enumerate(zip(zoe_losses, torch_losses)):
        assert a == pytest.approx(b, rel=2e-3, abs=2e-3), (step, zoe_losses, torch_losses)


# Per optimizer type of the config: its params and the torch optimizer the loop compares with
OPTIMIZERS = {"AdamW": (dict(lr=1e-3, weight_decay=0.0), torch.optim.AdamW),
              "Adagrad": (dict(lr=1e-2, weight_decay=0.0), torch.optim.Adagrad)}


def ds_config(nvme_path, stage=2, optimizer="AdamW"):
    """Stage 2: the optimizer state on NVMe; stage 3: the parameters too (paged through the
    GPU's device tier, their gradients streamed to the host); ``optimizer``: a type of
    OPTIMIZERS."""
    params = OPTIMIZERS[optimizer][0]
    zero = {"stage": stage, "offload_optimizer": {"device": "nvme", "nvme_path": nvme_path}}
    if stage == 3:
        zero["offload_param"] = {"device": "nvme", "nvme_path": nvme_path}
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 1.0,
        "optimizer": {"type": optimizer, "params": dict(params)},
        "scheduler": {"type": "WarmupLR",
                      "params": {"warmup_min_lr": 0, "warmup_max_lr": params["lr"],
                                 "warmup_num_steps": 4}},
        "zero_optimization": zero,
    }


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(),
                               torch.nn.Linear(64, 8)).cuda()


def micro_batches(count):
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 32, generator=generator).cuda(),
             torch.randn(4, 8, generator=generator).cuda()) for _ in range(count)]


@pytest.mark.parametrize("stage,optimizer,speculative", [
    (2, "AdamW", False), (3, "AdamW", False), (2, "Adagrad", False), (2, "AdamW", True)])
def test_initialize_from_a_deepspeed_config_on_a_cuda_model(tmp_path, stage, optimizer,
                                                            speculative):
    """At stage 2 the engine's backward hands each gradient to zoe as it becomes final on the
    boundary micro-batch, and with zoe.speculative the step starts there too."""
    batches = micro_batches(16)
    model = mlp()
    config = ds_config(str(tmp_path), stage, optimizer)
    if speculative:
        config["zoe"] = {"speculative": True}
    engine, zoe_optimizer, _, scheduler = zoe.torch.initialize(
        model=model, model_parameters=model.parameters(), config=config)
    for x, y in batches:
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
    got = [p.detach().cpu() for p in engine.module_state_dict().values()]
    if stage == 2:  # the device path (stage 3 pages the parameters instead)
        group = zoe_optimizer._groups[0]
        assert group.device.stats["handed_in_backward"] > 0
        speculated = group.zoe_group.speculation_stats()["chunks_speculative"]
        assert (speculated > 0) == speculative
    engine.close()

    reference = mlp()
    params, reference_class = OPTIMIZERS[optimizer]
    optimizer = reference_class(reference.parameters(), **params)
    schedule = WarmupLR(optimizer, warmup_min_lr=0, warmup_max_lr=params["lr"],
                        warmup_num_steps=4)
    for step in range(len(batches) // 2):
        for x, y in batches[2 * step : 2 * step + 2]:
            (torch.nn.functional.mse_loss(reference(x), y) / 2).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        optimizer.step()
        schedule.step()  # DeepSpeed's schedule, stepped after each optimizer step
        optimizer.zero_grad(set_to_none=True)
    want = [p.detach().cpu() for p in reference.state_dict().values()]
    assert engine.global_steps == len(batches) // 2
    for index, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=f"tensor {index}")


def zero_init_config(nvme_path, precision):
    """Stage 3 with the parameters on NVMe and the optimizer state in DRAM, as for a model
    built paged: ``precision`` None (fp32) or "bf16"."""
    document = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 3,
                              "offload_param": {"device": "nvme", "nvme_path": nvme_path},
                              "offload_optimizer": {"device": "cpu"}},
    }
    if precision is not None:
        document[precision] = {"enabled": True}
    return document


def build_on_the_gpu():
    """The model built on the GPU (its initialisation drawn from the GPU's generator), as a
    user builds one inside zero_init: ``with torch.device("cuda")``."""
    torch.manual_seed(0)
    with torch.device("cuda"):
        return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(),
                                   torch.nn.Linear(64, 8))


def train_engine(engine, batches):
    dtype = next(iter(engine.module_state_dict().values())).dtype
    for x, y in batches:
        engine.backward(torch.nn.functional.mse_loss(engine(x.to(dtype)).float(), y))
        engine.step()
    return {key: value.detach().cpu().clone() for key, value in engine.module_state_dict().items()}


@pytest.mark.parametrize("precision", [None, "bf16"])
def test_a_model_built_paged_on_the_gpu_trains_as_one_built_whole(tmp_path, precision):
    """zoe.torch.zero_init then zoe.torch.initialize from one DeepSpeed configuration, the
    model built on the GPU inside the context: its parameters are placeholders on the GPU
    (never whole in memory), and it trains as the same model built whole."""
    batches = micro_batches(8)
    for folder in ("paged", "whole"):
        (tmp_path / folder).mkdir()
    document = zero_init_config(str(tmp_path / "paged"), precision)
    with zoe.torch.zero_init(config=document) as construction:
        model = build_on_the_gpu()
    assert construction.parameters == 4
    assert all(param.device.type == "cuda" and param.stride() == (0,) * param.dim()
               for param in model.parameters())
    engine, _, _, _ = zoe.torch.initialize(model=model, config=document)
    try:
        assert engine._stage3.engine is construction.engine
        found = train_engine(engine, batches)
    finally:
        engine.close()

    engine, _, _, _ = zoe.torch.initialize(
        model=build_on_the_gpu(), config=zero_init_config(str(tmp_path / "whole"), precision))
    try:
        expected = train_engine(engine, batches)
    finally:
        engine.close()
    assert found.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(found[key], expected[key], rtol=1e-5, atol=1e-6, msg=key)
