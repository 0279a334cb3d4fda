"""The README's demo (examples/train_gpt.py) runs to its end on a few steps: every phase (the
model paged, the optimizer after backward and overlapped on the CPU twin, the comparison with
torch) and the plot, so a change that breaks the demo fails CI rather than a newcomer's first
command."""

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
DEMO = os.path.join(HERE, "..", "..", "..", "examples", "train_gpt.py")


def test_the_demo_runs_a_few_steps(tmp_path):
    plot = tmp_path / "demo.png"
    completed = subprocess.run(
        [sys.executable, DEMO, "--steps", "4", "--plot", str(plot), "--nvme-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=300, env=dict(os.environ),
    )
    assert completed.returncode == 0, completed.stdout[-2000:] + completed.stderr[-4000:]
    assert "max |loss difference| from torch" in completed.stdout
    assert plot.exists() and plot.stat().st_size > 0


BEYOND = os.path.join(HERE, "..", "..", "..", "examples", "train_beyond_memory.py")


def test_the_beyond_memory_demo_trains_a_state_larger_than_its_limit(tmp_path):
    """A small version of the demo's second part (about 0.9 GiB of state): inside a 512 MiB
    memory cgroup where one can be made (as root), else without a limit, the loss falls over 3
    steps and the state is reported against the memory."""
    completed = subprocess.run(
        [sys.executable, BEYOND, "--width", "768", "--layers", "8", "--steps", "3",
         "--limit", "512M", "--nvme-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=300, env=dict(os.environ),
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    assert "loss falls over the steps" in completed.stdout
    assert "of training state" in completed.stdout
