"""Gradient hooks: a callback once a parameter's gradient is accumulated into .grad (the device
path's copies, ZeRO stage 2's and stage 3's reductions), and the buckets of consecutive
parameters that ZeRO stages 1 and 2 reduce together."""

import torch


def on_gradient_accumulated(param, hook):
    """Registers ``hook()`` to run once the parameter's gradient is accumulated into .grad
    (register_post_accumulate_grad_hook where torch has it, else a hook on the AccumulateGrad
    node). Returns (handle, node to keep alive: None with the former)."""
    if hasattr(param, "register_post_accumulate_grad_hook"):
        return param.register_post_accumulate_grad_hook(lambda _: hook()), None
    with torch.enable_grad():  # an optimizer may be built under no_grad
        node = param.expand_as(param).grad_fn.next_functions[0][0]
    return node.register_hook(lambda *_: hook()), node


class Bucket:
    """Consecutive parameters of a param group reduced together (ZeRO stages 1 and 2): their
    indices in the group, and how many of their gradients are final in this iteration."""

    def __init__(self, group_index, indices):
        self.group_index = group_index
        self.indices = indices
        self.ready = 0  # gradients final so far in this iteration
        self.reduced = False

    def gradients(self):
        """What the bucket reduces, for a failure's message."""
        first, last = self.indices[0], self.indices[-1]
        params = f"parameter {first}" if first == last else f"parameters {first} to {last}"
        return f"the gradients of {params} of param group {self.group_index}"

    def reset(self):
        """Forgets the iteration: no gradient final, nothing reduced."""
        self.ready, self.reduced = 0, False


def buckets_of(group_index, params, bucket_elements):
    """A param group's parameters cut into buckets in order, each closed once it holds
    ``bucket_elements`` elements or more (0 or 1: one parameter per bucket), and where the
    parameters go from trainable to frozen (``requires_grad``) or back: a bucket holds either
    kind only, so the frozen ones, which get no hook (stage 2), never hold back the reduction of
    trainable ones during backward."""
    buckets, current, size = [], [], 0
    for index, param in enumerate(params):
        if current and params[current[-1]].requires_grad != param.requires_grad:
            buckets.append(Bucket(group_index, current))
            current, size = [], 0
        current.append(index)
        size += param.numel()
        if size >= bucket_elements:
            buckets.append(Bucket(group_index, current))
            current, size = [], 0
    if current:
        buckets.append(Bucket(group_index, current))
    return buckets
