"""A rank that dies in the middle of training. Its peers learn of it in their next collective
(gloo closes the connection); at every stage each raises zoe.Aborted naming the collective that
failed and the way out (restart every rank, load the latest checkpoint), promptly, where stages
0 to 2 raised the transport's RuntimeError; save_checkpoint then raises zoe.Aborted too, and
close() returns, instead of waiting for the process group's timeout."""

import os
import time

import pytest

import zoe
import zoe.torch
from conftest import gloo_rank, spawn_ranks
from initialize_script import ds_config, make_model, train_engine

WORLD = 2
JOIN_SECONDS = 120
# Far below the process group's timeout (conftest.gloo_rank: 30 s), which a rank left waiting
# in a collective would reach.
PROMPT_SECONDS = 15
ADVICE = ("another rank failed, died or timed out; the process group cannot be used again: "
          "restart every rank and load the latest checkpoint")


def survive_a_dead_peer(rank, stage, offload, failed, out_dir):
    """Both ranks take one step; rank 1 then dies, and rank 0's next iteration must fail."""
    config = ds_config(stage=stage, offload=offload, nvme_path=os.path.join(out_dir, f"nvme{rank}"),
                       world=WORLD)
    engine, _, _, _ = zoe.torch.initialize(model=make_model(), config=config)
    train_engine(engine, 0, 1, rank, WORLD)
    if rank == 1:
        os._exit(0)  # no clean-up: a crash
    started = time.monotonic()
    with pytest.raises(zoe.Aborted, match=f"^{failed} failed") as raised:
        train_engine(engine, 1, 2, rank, WORLD)
    assert ADVICE in str(raised.value)
    with pytest.raises(zoe.Aborted, match=ADVICE):
        engine.save_checkpoint(os.path.join(out_dir, "checkpoints"))
    if stage == 3:  # close() gathers the parameters back into the module, and cannot
        with pytest.raises(zoe.Aborted, match=r"The model's parameters \['0.weight', "
                                              r"'0.bias', '2.weight', '2.bias'\] \(4 of 4\) "
                                              r"keep their placeholders \(NaN\)"):
            engine.close()
        assert all(param.isnan().all() for param in engine.module.parameters())
    engine.close()  # closed already, or closing now
    assert time.monotonic() - started < PROMPT_SECONDS


def worker(rank, stage, offload, failed, out_dir):
    with gloo_rank(rank, WORLD, f"{out_dir}/init", out_dir):
        survive_a_dead_peer(rank, stage, offload, failed, out_dir)


@pytest.mark.parametrize("stage, offload, failed", [
    (0, "none", r"all_reduce of the gradients \(stage 0\)"),
    (1, "cpu", "all_reduce of the flags of which parameters have a gradient"),
    (2, "nvme", "reduction of the gradients of parameters 0 to 3 of param group 0"),
    (3, "cpu", "gather of parameter '0.weight'"),
])
def test_a_dead_peer_raises_aborted_on_the_others(tmp_path, stage, offload, failed):
    spawn_ranks(worker, (stage, offload, failed, str(tmp_path)), WORLD, str(tmp_path),
                JOIN_SECONDS)


class FailingTransport:
    """Stands in for a torch.distributed collective whose transport fails (a peer's connection
    closed), as it is called or, with ``async_op``, as its handle is waited for."""

    def __init__(self, function):
        self.function = function

    def __call__(self, *args, async_op=False, **kwargs):
        if async_op:
            return self
        self.wait()

    def wait(self):
        raise RuntimeError(f"{self.function}: Connection closed by peer")


def call_with_failing(comm, method):
    import torch

    values = torch.ones(4)
    if method == "all_reduce":
        comm.all_reduce(values, "the test's sums")
    elif method == "gather":
        comm.gather(values[:2], [2, 2], "the test's values")
    elif method == "reduce_to_owners":
        comm.reduce_to_owners(values, [0, 2, 4], "the test's gradients")
    else:  # wait: the reduction issued, its failure found when waited for
        comm.wait(comm.reduce_to_owners(values, [0, 2, 4], "the test's gradients", async_op=True),
                  "the test's gradients")


@pytest.mark.parametrize("method, transport, what", [
    ("all_reduce", "all_reduce", "all_reduce of the test's sums"),
    ("gather", "broadcast", "gather of the test's values"),
    ("reduce_to_owners", "reduce", "reduction of the test's gradients"),
    ("wait", "reduce", "reduction of the test's gradients"),
])
def test_every_collective_of_stages_1_and_2_raises_aborted(tmp_path, monkeypatch, method,
                                                             transport, what):
    """TorchCollectives, through which stages 1 and 2 make every collective, on two ranks of
    which this process is one (the other never joins: the transport fails first)."""
    import torch.distributed as dist

    from zoe.torch.distributed import TorchCollectives

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/init", rank=0, world_size=1)
    try:
        comm = TorchCollectives(dist.group.WORLD)
        comm.world_size = 2  # two parts, as over two ranks
        monkeypatch.setattr(dist, transport, FailingTransport(transport))
        with pytest.raises(zoe.Aborted, match=f"^{what} failed \\({ADVICE}\\): {transport}: "
                                              "Connection closed by peer"):
            call_with_failing(comm, method)
    finally:
        dist.destroy_process_group()
