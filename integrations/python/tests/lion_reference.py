"""Lion in plain torch, the reference the Lion tests compare zoe.torch.Lion with (torch has no
Lion): Chen et al. 2023, Algorithm 2 with decoupled weight decay, in fp32, each product and sum
its own operation (no fused multiply-add, as zoe's kernels):

    p <- p * (1 - lr * wd);  c <- m * beta1 + g * (1 - beta1);  p <- p + sign(c) * (-lr)
    m <- m * beta2 + g * (1 - beta2)

State per parameter: 'step' and 'exp_avg' (m), as zoe.torch.Lion's state dict names them."""

import torch


class ReferenceLion(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            lr, (beta1, beta2), decay = group["lr"], group["betas"], group["weight_decay"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(param, dtype=torch.float32)
                state["step"] += 1
                grad, moment = param.grad.float(), state["exp_avg"]
                param.mul_(1.0 - lr * decay)
                interpolated = torch.add(moment * beta1, grad * (1.0 - beta1))
                param.add_(torch.sign(interpolated) * (-lr))
                moment.copy_(torch.add(moment * beta2, grad * (1.0 - beta2)))
