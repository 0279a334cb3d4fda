"""zoe.torch with one slot per NVMe chunk: zoe.slots in the configuration zoe.torch passes to the
engine trains bit for bit like two slots, on half the NVMe bytes, and the engine's statistics
show the slots, the bytes on disk per parameter and the bytes written to the NVMe path."""

import torch

import zoe
import zoe.torch
from conftest import small_config
from test_optim import make_model, train_step


def train(nvme_dir, slots, steps=5):
    model = make_model()
    config = small_config(nvme_dir, offload="nvme", slots=slots)
    optimizer = zoe.torch.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, config=config)
    for step in range(steps):
        train_step(model, optimizer, step)
    stats = optimizer.engine.stats()
    state = {k: v.clone() for k, v in optimizer.state_dict()["state"][0].items()
             if torch.is_tensor(v)}
    optimizer.close()
    return model, stats, state


def test_single_slot_trains_like_two_slots_on_half_the_nvme_bytes(nvme_dir):
    one, stats_one, state_one = train(nvme_dir, 1)
    two, stats_two, state_two = train(nvme_dir, 2)
    for a, b in zip(one.parameters(), two.parameters()):
        assert torch.equal(a, b)
    assert state_one.keys() == state_two.keys()
    for key in state_one:
        assert torch.equal(state_one[key], state_two[key]), key
    group_one, group_two = stats_one["groups"][0], stats_two["groups"][0]
    assert group_one["slots"] == 1 and group_two["slots"] == 2
    assert group_one["broken"] is None
    assert 2 * group_one["nvme_bytes"] == group_two["nvme_bytes"]
    assert group_one["nvme_bytes_per_parameter"] * group_one["parameters"] == group_one["nvme_bytes"]
    # The initial state and five steps, each writing every chunk once, to the one NVMe path.
    written = group_one["nvme_writes"][0]
    assert written["bytes_written"] == 6 * written["bytes_written_last_step"] > 0
    assert written["bytes_written_last_step"] == group_one["nvme_bytes"]
    paths = {entry["path"]: entry for entry in stats_one["nvme_writes"]}
    assert paths[nvme_dir]["bytes_written_last_step"] == written["bytes_written_last_step"]
