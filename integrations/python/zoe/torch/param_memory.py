"""The memory of the parameters a zoe optimizer steps: each must be contiguous (zoe reads and
writes a parameter as one run of elements), and no two may share memory. zoe keeps a master copy
of each parameter and writes each updated copy back into its parameter, so two parameters over
one memory (views of one tensor, or one made with ``set_`` over the other's storage) would be
updated apart and each overwrite the other: silently not torch's result, where the updates of
both apply to the one memory. A tied weight is one Parameter held by two modules, which every
optimizer sees once."""

from .common import _invalid, _pager_of
from .stage3_checks import sharded_pager_of


def check_contiguous(named_params):
    """InvalidArgument naming the first of ``named_params`` ((description, tensor) pairs) that
    is not contiguous."""
    for description, param in named_params:
        if not param.is_contiguous():
            raise _invalid(f"{description} is not contiguous (a view such as a transpose, "
                           f"strides {param.stride()}): zoe's optimizers step a parameter's "
                           "memory as one run of elements; make it contiguous (with "
                           "torch.no_grad(): param.data = param.data.contiguous())")


def _memory_span(param):
    """(device, first byte, end byte) of the memory a parameter's elements are in; None for a
    parameter without memory of its own to compare: empty, on the meta device, or paged (its
    values live in zoe's tiers, not in the tensor)."""
    if param.numel() == 0 or param.device.type == "meta":
        return None
    if _pager_of(param) is not None or sharded_pager_of(param) is not None:
        return None
    extent = 1 + sum((size - 1) * abs(stride)
                     for size, stride in zip(param.shape, param.stride()))
    start = param.data_ptr()
    return param.device, start, start + extent * param.element_size()


def check_no_shared_memory(named_params):
    """InvalidArgument naming two of ``named_params`` ((description, tensor) pairs, such as
    ("parameter 0 of param group 1", param)) whose memory overlaps (see the module's
    documentation)."""
    spans = []
    for description, param in named_params:
        span = _memory_span(param)
        if span is not None:
            device, start, end = span
            spans.append((str(device), start, end, description, param))
    spans.sort(key=lambda span: span[:2])
    for before, after in zip(spans, spans[1:]):
        if before[0] != after[0] or after[1] >= before[2]:
            continue
        if before[4] is after[4]:
            raise _invalid(f"{before[3]} and {after[3]} are one parameter: give the optimizer "
                           "each parameter once")
        raise _invalid(
            f"{before[3]} and {after[3]} share memory (views of one tensor): zoe keeps a "
            "master copy of each parameter and writes each back, so they would be updated "
            "apart and overwrite each other; tie them as one nn.Parameter (assign the same "
            "Parameter to both modules), or give each its own memory (.clone())")


def params_named(group_index, params):
    """(description, tensor) of each of param group ``group_index``'s parameters, named by its
    place ("parameter 0 of param group 1")."""
    return [(f"parameter {index} of param group {group_index}", param)
            for index, param in enumerate(params)]


def group_params_named(param_groups):
    """params_named of every group of ``param_groups`` (lists of tensors), in order."""
    return [named for group_index, params in enumerate(param_groups)
            for named in params_named(group_index, params)]
