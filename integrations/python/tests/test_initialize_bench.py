"""bench/zero_bench.py --initialize in --small mode on 2 ranks: zoe's stages built through
zoe.torch.initialize run beside torch's ZeRO, and each reports the engine's breakdown (forward,
backward, step, and the collectives its stage makes: the optimizer's at stage 2, gathers and
reductions at stage 3). A check of behaviour, not of speed."""

import json
import os
import subprocess
import sys

import pytest

import zoe

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__)))))
BENCH = os.path.join(REPO, "bench", "zero_bench.py")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(zoe.__file__))),
         env.get("PYTHONPATH", "")])
    completed = subprocess.run(
        [sys.executable, BENCH, "--small", "--ranks", "2", "--initialize", "--impls",
         "zoe_s2_dram,zoe_s3_nvme,torch_zero_adamw",
         "--dir", str(tmp_path_factory.mktemp("initialize-bench"))],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    lines = [json.loads(line) for line in completed.stdout.splitlines() if line.startswith("{")]
    return {line["impl"]: line for line in lines if line["kind"] == "result"}


def test_zoe_implementations_ran_through_initialize(results):
    assert sorted(results) == ["ds_s2_dram", "ds_s3_nvme", "torch_zero_adamw"]
    for impl in ("ds_s2_dram", "ds_s3_nvme"):
        line = results[impl]
        for key in ("forward", "backward", "step"):
            assert line[f"breakdown_{key}_s"] > 0, (impl, key)
        assert line["state_target_met"], impl
    stage2, stage3 = results["ds_s2_dram"], results["ds_s3_nvme"]
    assert stage2["breakdown_optimizer_collectives_s"] > 0
    assert stage2["breakdown_gathers_s"] == stage2["breakdown_reductions_s"] == 0
    assert stage3["breakdown_gathers_s"] > 0 and stage3["breakdown_reductions_s"] > 0
    assert stage3["breakdown_optimizer_collectives_s"] == 0
    assert stage3["param_shard_bytes_per_rank"][0] > 0


def test_an_unknown_implementation_is_refused():
    completed = subprocess.run([sys.executable, BENCH, "--impls", "ds_s4_dram"],
                               capture_output=True, text=True, timeout=60)
    assert completed.returncode == 2 and "unknown implementations ['ds_s4_dram']" in \
        completed.stderr
