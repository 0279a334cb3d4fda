"""How fast the collectives ZeRO needs run on a torch.distributed backend, each way zoe could
build them: a sharded buffer's all-gather (gloo's ``all_gather``, or one ``broadcast`` per rank as
zoe.torch does) and its reduce-scatter (an ``all_reduce`` of the whole buffer, or one ``reduce``
per rank onto the part's owner, as zoe.torch does).

Spawns N ranks on this machine (gloo over a file rendezvous, 1 torch thread each); each round
times every method once, in the opposite order on odd rounds, after a barrier; a time is rank 0's
wall time for the whole collective. Prints one JSON line per (N, elements per rank, method) with
the median over the rounds, the rounds, and every sample:

    /usr/bin/python3 bench/collective_bench.py --ranks 2,3 --elements 262144,4194304 --rounds 7
"""

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _methods(rank, world, elements):
    """name -> a function running the collective once (its buffers made here, reused)."""
    shard = torch.randn(elements)
    gathered = torch.empty(elements * world)
    parts = list(gathered.split(elements))
    whole = torch.randn(elements * world)
    whole_parts = list(whole.split(elements))

    def all_gather():
        dist.all_gather(parts, shard)

    def broadcast_per_rank():
        parts[rank].copy_(shard)
        works = [dist.broadcast(part, src=owner, async_op=True) for owner, part in enumerate(parts)]
        for work in works:
            work.wait()

    def all_reduce():
        dist.all_reduce(whole)

    def reduce_per_rank():
        works = [dist.reduce(part, dst=owner, async_op=True)
                 for owner, part in enumerate(whole_parts)]
        for work in works:
            work.wait()

    return {
        "gather/all_gather": all_gather,
        "gather/broadcast_per_rank": broadcast_per_rank,
        "reduce_scatter/all_reduce": all_reduce,
        "reduce_scatter/reduce_per_rank": reduce_per_rank,
    }


def _rank_main(rank, world, init_file, sizes, rounds, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank,
                            world_size=world)
    results = []
    for elements in sizes:
        methods = _methods(rank, world, elements)
        names = list(methods)
        samples = {name: [] for name in names}
        for name in names:  # one untimed run each: connections and first-touch pages
            methods[name]()
        for round_index in range(rounds):
            for name in (names if round_index % 2 == 0 else names[::-1]):
                dist.barrier()
                start = time.perf_counter()
                methods[name]()
                samples[name].append(time.perf_counter() - start)
        for name in names:
            results.append({"ranks": world, "elements_per_rank": elements,
                            "bytes_per_rank": elements * 4, "method": name,
                            "median_s": statistics.median(samples[name]), "rounds": rounds,
                            "samples_s": samples[name]})
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="2,3", help="comma list of rank counts")
    parser.add_argument("--elements", default="262144,4194304",
                        help="comma list of fp32 elements per rank")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    sizes = [int(size) for size in args.elements.split(",")]
    for world in (int(n) for n in args.ranks.split(",")):
        with tempfile.TemporaryDirectory() as scratch:
            out = os.path.join(scratch, "results.pt")
            mp.spawn(_rank_main, nprocs=world,
                     args=(world, os.path.join(scratch, "rendezvous"), sizes, args.rounds, out))
            for line in torch.load(out):
                print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
