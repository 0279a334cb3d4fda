// The entry point of zoe_micro_bench: every bench/micro/*.cc registers its cases, this file
// alone defines main.
#include <benchmark/benchmark.h>

BENCHMARK_MAIN();
