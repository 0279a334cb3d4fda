"""Shared fixtures of the zoe Python tests: a temporary NVMe directory and small engines."""

import contextlib
import os
import shutil
import sys
import tempfile

# torch's vectorised CPU kernels use fused multiply-adds (AVX2/AVX-512 builds) in their SIMD bodies
# but not in their scalar tails; zoe's optimizer kernels never fuse. With ATen's portable kernels
# ("default" capability, chosen before torch is first imported) torch does the same IEEE
# arithmetic as zoe and the optimizer comparisons can demand identical bits.
if "torch" not in sys.modules:
    os.environ.setdefault("ATEN_CPU_CAPABILITY", "default")
EXACT_TORCH = os.environ.get("ATEN_CPU_CAPABILITY") == "default" and "torch" not in sys.modules

import pytest  # noqa: E402

import zoe  # noqa: E402


@pytest.fixture(autouse=True)
def adversarial_host_twin(monkeypatch):
    """zoe.torch.HostTwin() in a test is the adversarial twin (copies complete late, their
    destinations NaN until then), so a missing wait fails a test instead of passing by luck; a
    test that wants the plain twin says HostTwin(adversarial=False). The C++ host stand-in's
    counterpart is ZOE_DEVICE_ADVERSARIAL_US (scripts/run-tests.sh sets it)."""
    device = sys.modules.get("zoe.torch.device")  # imported by the tests that use the twin
    if device is None:
        return
    init = device.HostTwin.__init__
    names = init.__code__.co_varnames[1:init.__code__.co_argcount]
    defaults = dict(zip(names[len(names) - len(init.__defaults__):], init.__defaults__))
    if "adversarial" not in defaults:
        raise RuntimeError("HostTwin.__init__ has no default for 'adversarial': update "
                           "conftest.adversarial_host_twin")
    defaults["adversarial"] = True
    monkeypatch.setattr(init, "__defaults__", tuple(defaults.values()))


@pytest.fixture
def nvme_dir():
    """A fresh directory under /var/tmp for swap files, removed afterwards."""
    parent = "/var/tmp" if os.path.isdir("/var/tmp") else None
    path = tempfile.mkdtemp(prefix="zoe-pytest-", dir=parent)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def small_config(nvme_path=None, offload="cpu", **zoe_options):
    """A small engine configuration: host stand-in device, 64 KiB chunks, optional NVMe."""
    section = {"device": offload}
    if offload == "nvme":
        section["nvme_path"] = nvme_path
    options = {
        "device": "host",
        "chunk_size": "64K",
        "host_budget": "256M",
        "tensor_swap_bytes": "64M",
        "log_level": "warn",
    }
    options.update(zoe_options)
    return {"zero_optimization": {"stage": 3, "offload_optimizer": section}, "zoe": options}


@pytest.fixture
def engine(nvme_dir):
    """An engine with its optimizer state on NVMe (in nvme_dir)."""
    with zoe.Engine(small_config(nvme_dir, offload="nvme")) as e:
        yield e


@contextlib.contextmanager
def gloo_rank(rank, world, init_file, out_dir, timeout_seconds=30):
    """The body of a rank spawn_ranks started: the rank joined to a gloo group of ``world``
    ranks (rendezvous in ``init_file``), its traceback left in ``out_dir``/crash<rank>.txt for
    spawn_ranks to report, the group destroyed at the end."""
    import datetime
    import traceback

    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_seconds))
        yield
    except BaseException:
        with open(os.path.join(out_dir, f"crash{rank}.txt"), "w") as file:
            file.write(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn_ranks(worker, args, nprocs, out_dir, join_seconds):
    """Runs ``worker(rank, *args)`` on ``nprocs`` spawned processes; fails the test when they are
    still running after ``join_seconds`` (a hang: they are killed) or when a rank left a
    ``crash*.txt`` in ``out_dir``. torch is imported here so tests without it need not."""
    import datetime
    import glob

    import torch.multiprocessing as mp

    context = mp.start_processes(worker, args=args, nprocs=nprocs, join=False,
                                 start_method="spawn")
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=join_seconds)
    while not context.join(timeout=1):
        if datetime.datetime.now() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"ranks still running after {join_seconds} s: a hang")
    crashes = glob.glob(os.path.join(out_dir, "crash*.txt"))
    assert not crashes, open(crashes[0]).read()
