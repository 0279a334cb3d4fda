#!/usr/bin/python3
"""Seconds per optimizer step as a CPU-offload user sees them.

The model is LAYERS x Linear(2048, 2048) (16 layers: 67 M parameters) in fp32 or bf16, with
gradients set; every optimizer steps the same model from the same seed on THREADS threads.
OPTIMIZER (adamw, the default; adagrad; lion) picks the algorithm every implementation steps:

  torch_foreach       torch.optim.AdamW(foreach=True) (adagrad: torch.optim.Adagrad(foreach=True));
                      a bf16 model keeps fp32 master copies (the mixed-precision recipe):
                      gradients widened, step, parameters narrowed back
  lion_pytorch        lion: the update loop of the lion-pytorch package (torch has no Lion), per
                      parameter, with the same fp32 master copies for a bf16 model
  deepspeed_cpu_adam  adamw: DeepSpeed's CPU Adam driven per parameter as DeepSpeedCPUAdam.step()
                      does (fp32 masters for a bf16 model, as above), when its extension is built
                      (../shared/peers/setup; ZOE_PEERS_KIT names the kit's folder)
  zoe_cpu             zoe.torch.AdamW (Adagrad, Lion)(offload="cpu"), exact arithmetic (the
                      defaults; for an fp32 model that is the zero-copy form: the parameters are
                      the master weights)
  zoe_cpu_copy        the same with zero_copy=False: a separate fp32 master, the updated
                      parameters written back by the kernel's pass (what a bf16 model always does)
  zoe_cpu_fast        zoe_cpu with zoe.arithmetic = "fast"
  zoe_cpu_bf16_moments, zoe_cpu_int8_moments
                      zoe_cpu with moment_dtype "bf16" or "int8" (fewer bytes per parameter,
                      at the moments' precision: docs/int8-moments.md)

Each round builds every optimizer in turn, in the opposite order on odd rounds, takes one
untimed step (state creation) and STEPS timed ones; a round's figure is the median of its
steps, the reported figure the median over ROUNDS rounds. With MODE=interleaved every optimizer
is built once (each on its own copy of the model) and their steps alternate one by one, ROUNDS x
STEPS timed steps each, the figure being the median of those: on a shared machine whose load
drifts, neighbouring steps see the same load. One JSON line per optimizer and model dtype, then
one with the ratios. Environment: OPTIMIZER (adamw), THREADS (2), LAYERS (16), STEPS (5),
ROUNDS (3), DTYPES ("fp32,bf16"), IMPLS (a comma list of the names above; default all).

  ZOE_LIBRARY=build/release/integrations/libzoe.so PYTHONPATH=integrations/python \\
    /usr/bin/python3 bench/user_step.py
"""
import json
import os
import statistics
import sys
import time

THREADS = int(os.environ.get("THREADS", "2"))
os.environ["OMP_NUM_THREADS"] = str(THREADS)

import torch  # noqa: E402  (after OMP_NUM_THREADS)

import zoe.torch as zt  # noqa: E402

torch.set_num_threads(THREADS)

WIDTH = 2048
LAYERS = int(os.environ.get("LAYERS", "16"))
STEPS = int(os.environ.get("STEPS", "5"))
ROUNDS = int(os.environ.get("ROUNDS", "3"))
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
OPTIMIZER = os.environ.get("OPTIMIZER", "adamw")
HYPERS = {
    "adamw": dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01),
    "adagrad": dict(lr=1e-2, eps=1e-10, weight_decay=0.01),
    "lion": dict(lr=1e-4, betas=(0.9, 0.99), weight_decay=0.01),
}
HYPER = HYPERS[OPTIMIZER]
ZOE_CLASSES = {"adamw": zt.AdamW, "adagrad": zt.Adagrad, "lion": zt.Lion}


def make_model(dtype):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    model = model.to(dtype)
    for p in model.parameters():
        p.grad = (torch.randn(p.shape) * 1e-3).to(dtype)
    return model


def load_deepspeed():
    """DeepSpeed's CPU Adam extension, or (None, why not)."""
    here = os.path.dirname(os.path.abspath(__file__))
    kit = os.environ.get("ZOE_PEERS_KIT", os.path.join(here, "..", "..", "shared", "peers"))
    try:
        sys.path.insert(0, os.path.abspath(kit))
        import ds_ops

        return ds_ops.load_cpu_adam(), None
    except Exception as error:  # absent kit, unbuilt extension: reported, not fatal
        return None, f"{type(error).__name__}: {error}"


class MasterCopies:
    """fp32 master copies of a low-precision model: what a user of an fp32-only optimizer keeps.
    Each step widens the gradients into the masters', steps, and narrows the masters back."""

    def __init__(self, params):
        self.params = list(params)
        self.masters = [p.detach().float() for p in self.params]
        for p, m in zip(self.params, self.masters):
            m.grad = torch.empty_like(m)

    def widen_grads(self):
        for p, m in zip(self.params, self.masters):
            m.grad.copy_(p.grad)

    def narrow_params(self):
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                p.copy_(m)


class LionPytorch(torch.optim.Optimizer):
    """lion-pytorch's Lion.step(): per parameter, in place (decoupled weight decay, the sign of
    the interpolation, then the momentum)."""

    def __init__(self, params, lr, betas, weight_decay):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            lr, (beta1, beta2), decay = group["lr"], group["betas"], group["weight_decay"]
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                exp_avg = state["exp_avg"]
                p.mul_(1 - lr * decay)
                update = exp_avg.clone().mul_(beta1).add(p.grad, alpha=1 - beta1).sign_()
                p.add_(update, alpha=-lr)
                exp_avg.mul_(beta2).add_(p.grad, alpha=1 - beta2)


class TorchOptimizer:
    """The torch peer of OPTIMIZER: torch's foreach AdamW or Adagrad, or lion-pytorch's loop."""

    def __init__(self, model):
        params = list(model.parameters())
        self.copies = MasterCopies(params) if params[0].dtype != torch.float32 else None
        stepped = self.copies.masters if self.copies else params
        if OPTIMIZER == "lion":
            self.optimizer = LionPytorch(stepped, **HYPER)
        else:
            cls = torch.optim.AdamW if OPTIMIZER == "adamw" else torch.optim.Adagrad
            self.optimizer = cls(stepped, foreach=True, **HYPER)

    def step(self):
        if self.copies:
            self.copies.widen_grads()
        self.optimizer.step()
        if self.copies:
            self.copies.narrow_params()


class DeepSpeedCpuAdam:
    """DeepSpeedCPUAdam.step(): one adam_update per parameter, state fp32."""

    def __init__(self, ds, model, optimizer_id):
        self.ds, self.oid, self.step_id = ds, optimizer_id, 0
        params = list(model.parameters())
        self.copies = MasterCopies(params) if params[0].dtype != torch.float32 else None
        self.params = self.copies.masters if self.copies else params
        self.state = [(torch.zeros_like(p), torch.zeros_like(p)) for p in self.params]
        b1, b2 = HYPER["betas"]
        ds.create_adam(optimizer_id, HYPER["lr"], b1, b2, HYPER["eps"], HYPER["weight_decay"],
                       True, False)

    def step(self):
        if self.copies:
            self.copies.widen_grads()
        self.step_id += 1
        b1, b2 = HYPER["betas"]
        for p, (m, v) in zip(self.params, self.state):
            self.ds.adam_update(self.oid, self.step_id, HYPER["lr"], b1, b2, HYPER["eps"],
                                HYPER["weight_decay"], True, p.data, p.grad, m, v)
        if self.copies:
            self.copies.narrow_params()

    def close(self):
        self.ds.destroy_adam(self.oid)


def zoe_optimizer(model, arithmetic, zero_copy=None, moment_dtype=None):
    config = zt.engine_config("cpu", moment_dtype=moment_dtype, arithmetic=arithmetic)
    return ZOE_CLASSES[OPTIMIZER](model.parameters(), config=json.dumps(config),
                                  zero_copy=zero_copy, **HYPER)


def makers(ds):
    out = {
        "lion_pytorch" if OPTIMIZER == "lion" else "torch_foreach": TorchOptimizer,
        "zoe_cpu": lambda model: zoe_optimizer(model, "exact"),
        "zoe_cpu_copy": lambda model: zoe_optimizer(model, "exact", zero_copy=False),
        "zoe_cpu_fast": lambda model: zoe_optimizer(model, "fast"),
        "zoe_cpu_bf16_moments": lambda model: zoe_optimizer(model, "exact", moment_dtype="bf16"),
        "zoe_cpu_int8_moments": lambda model: zoe_optimizer(model, "exact", moment_dtype="int8"),
    }
    if ds is not None:
        ids = iter(range(1, 1 << 30))
        out["deepspeed_cpu_adam"] = lambda model: DeepSpeedCpuAdam(ds, model, next(ids))
    wanted = os.environ.get("IMPLS")
    if wanted:
        out = {name: make for name, make in out.items() if name in wanted.split(",")}
    return out


def time_round(make, dtype):
    """Median seconds of STEPS steps after one untimed step, and the parameter count."""
    model = make_model(dtype)
    optimizer = make(model)
    optimizer.step()
    samples = []
    for _ in range(STEPS):
        start = time.perf_counter()
        optimizer.step()
        samples.append(time.perf_counter() - start)
    count = sum(p.numel() for p in model.parameters())
    if hasattr(optimizer, "close"):
        optimizer.close()
    return statistics.median(samples), count


def time_interleaved(impls, dtype):
    """Per optimizer: ROUNDS * STEPS step times, the optimizers' steps alternating one by one."""
    built = {name: make(make_model(dtype)) for name, make in impls.items()}
    for optimizer in built.values():
        optimizer.step()  # state creation, untimed
    times = {name: [] for name in built}
    for index in range(ROUNDS * STEPS):
        order = list(built) if index % 2 == 0 else list(reversed(built))
        for name in order:
            start = time.perf_counter()
            built[name].step()
            times[name].append(time.perf_counter() - start)
    for optimizer in built.values():
        if hasattr(optimizer, "close"):
            optimizer.close()
    return times


def main():
    ds, why_not = load_deepspeed() if OPTIMIZER == "adamw" else (None, None)
    if why_not is not None:
        print(json.dumps({"impl": "deepspeed_cpu_adam", "skipped": why_not}))
    impls = makers(ds)
    for dtype_name in os.environ.get("DTYPES", "fp32,bf16").split(","):
        dtype = DTYPES[dtype_name]
        times = {name: [] for name in impls}
        count = sum(p.numel() for p in make_model(dtype).parameters())
        interleaved = os.environ.get("MODE") == "interleaved"
        if interleaved:
            times = time_interleaved(impls, dtype)
        for round_index in range(0 if interleaved else ROUNDS):
            order = list(impls) if round_index % 2 == 0 else list(reversed(impls))
            for name in order:
                seconds, count = time_round(impls[name], dtype)
                times[name].append(seconds)
        medians = {name: statistics.median(samples) for name, samples in times.items()}
        for name, seconds in medians.items():
            print(json.dumps({
                "impl": name, "optimizer": OPTIMIZER, "model_dtype": dtype_name, "params": count,
                "threads": THREADS, "steps": STEPS, "rounds": ROUNDS,
                "mode": "interleaved" if interleaved else "rounds",
                "seconds_per_step": round(seconds, 5),
                "gparams_per_s": round(count / seconds / 1e9, 3),
                "samples_seconds" if interleaved else "round_seconds": [
                    round(s, 5) for s in times[name]],
            }))
        ratios = {"model_dtype": dtype_name}
        for zoe_name in (name for name in medians if name.startswith("zoe_")):
            for peer in ("deepspeed_cpu_adam", "torch_foreach", "lion_pytorch"):
                if zoe_name in medians and peer in medians:
                    ratios[f"{zoe_name}_speedup_vs_{peer}"] = round(
                        medians[peer] / medians[zoe_name], 2)
        print(json.dumps(ratios))


if __name__ == "__main__":
    main()
