"""bench/zero_bench.py in --small mode on 2 ranks: every implementation that can run here produced
its timings, each rank's zoe optimizer state is 1/N of the whole within one chunk (and the ranks'
shards add up to the whole), the counters of bytes moved and time in collectives are filled, and
FSDP's line says why it did not run instead of showing figures. A check of behaviour, not of
speed."""

import json
import os
import subprocess
import sys

import pytest

import zoe

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__)))))
BENCH = os.path.join(REPO, "bench", "zero_bench.py")
WORLD = 2


@pytest.fixture(scope="module")
def lines(tmp_path_factory):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(zoe.__file__))),
         env.get("PYTHONPATH", "")])
    completed = subprocess.run(
        [sys.executable, BENCH, "--small", "--ranks", str(WORLD),
         "--dir", str(tmp_path_factory.mktemp("zero-bench"))],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    return [json.loads(line) for line in completed.stdout.splitlines() if line.startswith("{")]


def results(lines):
    return {line["impl"]: line for line in lines if line["kind"] == "result"}


def test_every_runnable_implementation_produced_timings(lines):
    found = results(lines)
    expected = ["zoe_s1_dram", "zoe_s1_nvme", "zoe_s2_dram", "zoe_s2_nvme", "zoe_s3_dram",
                "zoe_s3_nvme", "torch_zero_adamw"]
    assert sorted(found) == sorted(expected)
    for impl, line in found.items():
        assert line["world"] == WORLD
        for key in ("iteration_s", "step_s", "forward_backward_s"):
            assert line[key] > 0, (impl, key)
        assert line["collective_s_per_iteration"] > 0, impl  # every one reduces gradients
        assert len(line["state_bytes_per_rank"]) == WORLD


def test_zoe_state_per_rank_is_one_nth_within_one_chunk(lines):
    config = next(line for line in lines if line["kind"] == "config")
    for impl, line in results(lines).items():
        if not impl.startswith("zoe_"):
            continue
        total = config["parameters"] * 12  # fp32 master weights and two moments
        assert line["state_bytes_total"] == total
        assert sum(line["state_bytes_per_rank"]) == total, impl  # the shards cover the whole
        for state in line["state_bytes_per_rank"]:
            assert 0 < state <= total / WORLD + line["one_chunk_state_bytes"], impl
        assert line["state_target_met"] is True


def test_bytes_moved_per_tier(lines):
    found = results(lines)
    for impl in ("zoe_s1_nvme", "zoe_s2_nvme", "zoe_s3_nvme"):
        line = found[impl]
        assert all(value > 0 for value in line["state_nvme_bytes_per_rank"]), impl
        # each step's state was read from NVMe or found still in a pipeline buffer (with a
        # buffer per chunk, the automatic count where the pool has room, all of it is)
        assert all(read + reused > 0 for read, reused in zip(
            line["optimizer_nvme_read_per_step"], line["optimizer_nvme_reused_per_step"])), impl
        assert all(value > 0 for value in line["optimizer_nvme_written_per_step"]), impl
    for impl in ("zoe_s1_dram", "zoe_s2_dram", "zoe_s3_dram"):
        assert found[impl]["state_nvme_bytes_per_rank"] == [0] * WORLD, impl
    # Stage 3's parameters homed on NVMe are read back from it every iteration.
    stage3 = found["zoe_s3_nvme"]
    assert all(value > 0 for value in stage3["link_nvme_to_host_per_step"])
    assert all(value > 0 for value in stage3["param_shard_bytes_per_rank"])


def test_fsdp_reports_what_failed_instead_of_figures(lines):
    fsdp = [line for line in lines if line["kind"] == "fsdp"]
    assert len(fsdp) == 1
    line = fsdp[0]
    if line["ran"]:  # a torch that runs it would need timings: this bench does not fake them
        pytest.fail("FSDP ran; the bench has no timing path for it yet")
    assert line["fsdp_attempt"] and all(message for message in line["fsdp_attempt"])
    assert "iteration_s" not in line
    targets = next(line for line in lines if line["kind"] == "targets")
    assert targets["step_time_vs_fsdp"].startswith("not measured")


COLLECTIVE_BENCH = os.path.join(REPO, "bench", "collective_bench.py")


def test_collective_bench_times_every_method_on_every_size(tmp_path):
    """bench/collective_bench.py on 2 ranks, two sizes, 2 rounds: a line per (size, method) with
    the rounds' samples and their median."""
    completed = subprocess.run(
        [sys.executable, COLLECTIVE_BENCH, "--ranks", "2", "--elements", "1,4096",
         "--rounds", "2"],
        capture_output=True, text=True, timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    got = [json.loads(line) for line in completed.stdout.splitlines()]
    methods = ["gather/all_gather", "gather/broadcast_per_rank", "reduce_scatter/all_reduce",
               "reduce_scatter/reduce_per_rank"]
    assert [(line["elements_per_rank"], line["method"]) for line in got] == [
        (size, method) for size in (1, 4096) for method in methods]
    for line in got:
        assert line["ranks"] == 2 and line["rounds"] == 2 and len(line["samples_s"]) == 2
        assert line["median_s"] == pytest.approx(sum(line["samples_s"]) / 2)


# How far two resident-size readings of one count can differ: Linux keeps it in a per-CPU
# counter (percpu_counter, batch max(32, 2 * nr_cpus) pages) and reads the sum without the CPUs'
# pending deltas, each under one batch either way. One reading can be high by nr_cpus batches
# (frees not yet folded in) and the other low by as many (faults not yet folded in).
CPUS = os.cpu_count() or 1
RSS_READING_SLACK = 2 * CPUS * max(32, 2 * CPUS) * os.sysconf("SC_PAGE_SIZE")


def test_peak_rss_is_each_implementations_own(lines):
    for impl, line in results(lines).items():
        starts, peaks = line["rss_start_bytes_per_rank"], line["peak_rss_bytes_per_rank"]
        assert len(peaks) == WORLD, impl
        for start, end, peak in zip(starts, line["rss_bytes_per_rank"], peaks):
            assert 0 < start <= peak + RSS_READING_SLACK, impl
            assert 0 < end <= peak + RSS_READING_SLACK, impl
