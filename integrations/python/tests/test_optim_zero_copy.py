"""zoe.torch.AdamW's zero-copy form (the fp32 parameters are the master): the same parameters and
state as the copy form bit for bit over several steps (odd sizes, a parameter that is a view at an
odd offset of a larger storage, a parameter without a gradient in some steps), state_dict and
checkpoint round trips across the two forms, when it is the default and when it is refused."""

import copy

import pytest
import torch

import zoe
import zoe.torch
from conftest import small_config


class OddModel(torch.nn.Module):
    """Odd sizes, a parameter that views a larger storage at an odd offset, and a head used on
    even steps only (no gradient on odd steps)."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.first = torch.nn.Linear(13, 7)
        storage = torch.randn(7 * 5 + 11)
        self.shared = torch.nn.Parameter(storage[3 : 3 + 7 * 5].view(7, 5))
        self.head = torch.nn.Linear(5, 3)

    def forward(self, x, step):
        hidden = torch.tanh(self.first(x)) @ self.shared
        return self.head(hidden) if step % 2 == 0 else hidden[:, :3]


def train(model, optimizer, steps, start=0):
    for step in range(start, start + steps):
        optimizer.zero_grad(set_to_none=True)
        generator = torch.Generator().manual_seed(500 + step)
        x = torch.randn(9, 13, generator=generator)
        y = torch.randn(9, 3, generator=generator)
        torch.nn.functional.mse_loss(model(x, step), y).backward()
        optimizer.step()


def assert_same_bits(a, b):
    for (name, x), (_, y) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(x, y), name


def assert_same_state(a, b):
    sa, sb = a.state_dict()["state"], b.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for index in sa:
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(sa[index][key], sb[index][key]), (index, key)


def pair(**options):
    zero_model, copy_model = OddModel(), OddModel()
    zero_opt = zoe.torch.AdamW(zero_model.parameters(), lr=1e-2, weight_decay=0.05, **options)
    copy_opt = zoe.torch.AdamW(copy_model.parameters(), lr=1e-2, weight_decay=0.05,
                               zero_copy=False, **options)
    return zero_model, zero_opt, copy_model, copy_opt


def test_zero_copy_is_the_default_for_fp32_cpu_parameters_and_matches_the_copy_form():
    zero_model, zero_opt, copy_model, copy_opt = pair()
    assert zero_model.shared.data_ptr() % 64 != 0  # the view starts 12 bytes into its storage
    train(zero_model, zero_opt, 7)
    train(copy_model, copy_opt, 7)
    assert zero_opt._groups[0].zoe_group.master_in_params
    assert not copy_opt._groups[0].zoe_group.master_in_params
    assert_same_bits(zero_model, copy_model)
    assert_same_state(zero_opt, copy_opt)
    # The head had no gradient on odd steps: 4 steps of 7.
    assert int(zero_opt.state_dict()["state"][3]["step"]) == 4
    zero_opt.close()
    copy_opt.close()


@pytest.mark.parametrize("moment_dtype", ["bf16", "int8"])
def test_zero_copy_with_low_precision_moments_matches_the_copy_form(moment_dtype):
    zero_model, zero_opt, copy_model, copy_opt = pair(moment_dtype=moment_dtype)
    train(zero_model, zero_opt, 5)
    train(copy_model, copy_opt, 5)
    assert_same_bits(zero_model, copy_model)
    assert_same_state(zero_opt, copy_opt)
    zero_opt.close()
    copy_opt.close()


def test_state_dict_round_trip_across_the_two_forms():
    zero_model, zero_opt, copy_model, copy_opt = pair()
    train(zero_model, zero_opt, 4)
    train(copy_model, copy_opt, 4)
    # zero copy -> copy and copy -> zero copy, each continued against the original.
    zero_back_model = copy.deepcopy(copy_model)
    zero_back = zoe.torch.AdamW(zero_back_model.parameters(), lr=0.5)
    zero_back.load_state_dict(copy_opt.state_dict())
    copy_back_model = copy.deepcopy(zero_model)
    copy_back = zoe.torch.AdamW(copy_back_model.parameters(), lr=0.5, zero_copy=False)
    copy_back.load_state_dict(zero_opt.state_dict())
    for model, optimizer in ((zero_model, zero_opt), (zero_back_model, zero_back),
                             (copy_back_model, copy_back)):
        train(model, optimizer, 3, start=4)
    assert zero_back._groups[0].zoe_group.master_in_params
    assert_same_bits(zero_back_model, zero_model)
    assert_same_bits(copy_back_model, zero_model)
    assert_same_state(zero_back, zero_opt)
    for optimizer in (zero_opt, copy_opt, zero_back, copy_back):
        optimizer.close()


def test_checkpoint_round_trip_restores_the_parameters(tmp_path):
    zero_model, zero_opt, copy_model, copy_opt = pair()
    train(zero_model, zero_opt, 3)
    saved = copy.deepcopy(zero_model.state_dict())
    zero_opt.save_checkpoint(str(tmp_path / "zero"))
    train(zero_model, zero_opt, 2, start=3)
    assert not torch.equal(zero_model.first.weight, saved["first.weight"])
    zero_opt.load_checkpoint(str(tmp_path / "zero"))
    for name, value in zero_model.state_dict().items():
        assert torch.equal(value, saved[name]), name
    # The copy form loads the zero-copy checkpoint, and both go on alike.
    copy_opt.load_checkpoint(str(tmp_path / "zero"))
    assert_same_bits(copy_model, zero_model)
    train(zero_model, zero_opt, 2, start=3)
    train(copy_model, copy_opt, 2, start=3)
    assert_same_bits(copy_model, zero_model)
    assert_same_state(zero_opt, copy_opt)
    zero_opt.close()
    copy_opt.close()


def test_in_place_writes_reach_the_master():
    model, optimizer, _, other = pair()
    other.close()
    train(model, optimizer, 2)
    with torch.no_grad():
        model.first.weight.fill_(0.25)
    offset = 0
    for param in model.parameters():  # the group holds the parameters in this order
        if param is model.first.weight:
            break
        offset += param.numel()
    master = torch.empty(model.first.weight.numel())
    optimizer._groups[0].zoe_group.read_state(zoe.StateSlot.MASTER, offset, master.numel(),
                                        master.data_ptr())
    assert torch.all(master == 0.25)
    optimizer.close()


def test_replaced_parameter_storage_is_refused(tmp_path):
    model, optimizer, _, other = pair()
    other.close()
    train(model, optimizer, 1)
    model.first.weight.data = model.first.weight.data.clone()
    with pytest.raises(zoe.FailedPrecondition, match="parameter 1 of param group 0.*zero_copy"):
        train(model, optimizer, 1, start=1)
    with pytest.raises(zoe.FailedPrecondition, match="storage was replaced"):
        optimizer.save_checkpoint(str(tmp_path / "ckpt"))
    optimizer.close()


def test_where_zero_copy_does_not_apply(nvme_dir):
    bf16 = OddModel().to(torch.bfloat16)
    optimizer = zoe.torch.AdamW(bf16.parameters())
    train_bf16 = [p for p in bf16.parameters()]
    for p in train_bf16:
        p.grad = torch.ones_like(p)
    optimizer.step()
    assert not optimizer._groups[0].zoe_group.master_in_params
    optimizer.close()
    insisted = zoe.torch.AdamW(OddModel().to(torch.bfloat16).parameters(), zero_copy=True)
    with pytest.raises(zoe.InvalidArgument, match="zero_copy=True: parameter 0 .*bfloat16"):
        insisted.save_checkpoint(nvme_dir + "/x")
    insisted.close()
    on_disk = zoe.torch.AdamW(OddModel().parameters(), config=small_config(nvme_dir, "nvme"),
                              zero_copy=True)
    with pytest.raises(zoe.InvalidArgument, match="NVMe"):
        on_disk.save_checkpoint(nvme_dir + "/y")
    on_disk.close()
    with pytest.raises(zoe.InvalidArgument, match="zero_copy"):
        zoe.torch.AdamW(OddModel().parameters(), zero_copy="yes")
