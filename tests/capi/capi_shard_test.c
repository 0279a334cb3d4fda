/* Description: sharded optimizer groups through the C API from plain C: N = 2 and 3 engines in N
 * threads, whose collectives exchange buffers in memory, step a group cut into uneven shards, and
 * every rank's parameters and shard state equal those of one unsharded group stepped with the
 * averaged gradients -- with clipping active, a skipped (NaN) step, a segment without a gradient
 * on every rank and one without a gradient on one rank only, the updated parameters moved by the
 * all-gather or by the optional broadcast callback; a rank whose arguments are refused
 * stopping its peer too; and the errors of bad collectives. */
#define _XOPEN_SOURCE 700
#include <ftw.h>
#include <math.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "capi_check.h"
#include "zoe.h"

enum { kMaxRanks = 3, kCount = 1001, kSegments = 4, kSteps = 6, kSubGroup = 128 };
static const uint64_t kSegmentLengths[kSegments] = {300, 0, 401, 300};
static const char* kOptim =
    "{\"name\": \"w\", \"type\": \"AdamW\", \"lr\": 0.01, \"weight_decay\": 0.01,"
    " \"max_grad_norm\": 0.5, \"segments\": [300, 0, 401, 300]}";
enum { kNanStep = 2, kAbsentStep = 3 }; /* 0-based steps with a NaN / absent gradients */

static char root[256];

static int remove_entry(const char* path, const struct stat* st, int flag, struct FTW* ftw) {
  (void)st;
  (void)flag;
  (void)ftw;
  return remove(path);
}

/* An engine whose optimizer state lives on NVMe under root/<name>, in sub-groups of kSubGroup. */
static zoe_status create_engine(const char* name, zoe_engine** out) {
  char path[400];
  char config[1024];
  snprintf(path, sizeof path, "%s/%s", root, name);
  if (mkdir(path, 0700) != 0) return ZOE_ERR_IO;
  snprintf(config, sizeof config,
           "{\"zero_optimization\": {\"sub_group_size\": %d,"
           " \"offload_optimizer\": {\"device\": \"nvme\", \"nvme_path\": \"%s\"}},"
           " \"zoe\": {\"host_budget\": \"64M\", \"tensor_host_budget\": \"1M\","
           " \"tensor_swap_bytes\": \"1M\", \"device\": \"host\", \"device_budget\": \"1M\"}}",
           kSubGroup, path);
  return zoe_engine_create(config, out);
}

/* ---- an in-memory communicator: every rank publishes its buffer, then reads its peers' ---------
 */

/* How the ranks' collectives are given: without broadcast, with it, or with it set beyond the
 * struct_size of a caller built before it existed (zoe must not see it). */
enum { kNoBroadcast, kBroadcast, kBroadcastBeyondSize };

typedef struct communicator {
  int world;
  int collectives_kind; /* kNoBroadcast, kBroadcast or kBroadcastBeyondSize */
  pthread_barrier_t barrier;
  const void* published[kMaxRanks];
  int all_gathers, broadcasts; /* calls made, counted by rank 0 */
} communicator;

typedef struct rank_context {
  communicator* comm;
  int rank;
} rank_context;

static void publish(rank_context* c, const void* buffer) {
  c->comm->published[c->rank] = buffer;
  pthread_barrier_wait(&c->comm->barrier);
}

static int all_reduce_sum(void* context, double* values, size_t count) {
  rank_context* c = context;
  double* sum = calloc(count, sizeof(double));
  size_t i;
  int r;
  publish(c, values);
  for (r = 0; r < c->comm->world; ++r) {
    for (i = 0; i < count; ++i) sum[i] += ((const double*)c->comm->published[r])[i];
  }
  pthread_barrier_wait(&c->comm->barrier); /* every rank has read every buffer */
  memcpy(values, sum, count * sizeof(double));
  free(sum);
  return 0;
}

static uint64_t offset_of(const uint64_t* counts, int rank) {
  uint64_t offset = 0;
  int r;
  for (r = 0; r < rank; ++r) offset += counts[r];
  return offset;
}

static int reduce_scatter_sum(void* context, const float* send, float* recv,
                              const uint64_t* counts) {
  rank_context* c = context;
  const uint64_t offset = offset_of(counts, c->rank);
  uint64_t i;
  int r;
  publish(c, send);
  for (i = 0; i < counts[c->rank]; ++i) {
    float sum = 0.0f;
    for (r = 0; r < c->comm->world; ++r) sum += ((const float*)c->comm->published[r])[offset + i];
    recv[i] = sum;
  }
  pthread_barrier_wait(&c->comm->barrier);
  return 0;
}

static int all_gather(void* context, const float* send, float* recv, const uint64_t* counts) {
  rank_context* c = context;
  int r;
  if (c->rank == 0) ++c->comm->all_gathers;
  publish(c, send);
  for (r = 0; r < c->comm->world; ++r) {
    memcpy(recv + offset_of(counts, r), c->comm->published[r], counts[r] * sizeof(float));
  }
  pthread_barrier_wait(&c->comm->barrier);
  return 0;
}

/* Each segment's bytes on its root copied to every other rank's own pointer. */
static int broadcast(void* context, const int32_t* roots, void* const* data, const uint64_t* bytes,
                     size_t count) {
  rank_context* c = context;
  size_t i;
  if (c->rank == 0) ++c->comm->broadcasts;
  for (i = 0; i < count; ++i) {
    publish(c, data[i]);
    if (roots[i] != c->rank) memcpy(data[i], c->comm->published[roots[i]], bytes[i]);
    pthread_barrier_wait(&c->comm->barrier);
  }
  return 0;
}

static int barrier(void* context) {
  rank_context* c = context;
  pthread_barrier_wait(&c->comm->barrier);
  return 0;
}

/* ---- the training run of one rank, and of the unsharded reference -----------------------------
 */

static float initial_param(size_t i) { return 0.5f - 0.001f * (float)(i % 997); }

/* Rank `rank`'s gradient of element i at `step`. */
static float gradient(int step, int rank, size_t i) {
  return 0.05f * sinf(0.01f * (float)(i * (size_t)(step + 1)) + (float)rank) + 0.01f * (float)rank;
}

/* Whether `rank` has a gradient for segment s at `step`: at kAbsentStep segment 2 has none on any
 * rank and segment 3 none on rank 0. */
static int has_gradient(int step, int rank, int s) {
  if (step != kAbsentStep) return 1;
  if (s == 2) return 0;
  return !(s == 3 && rank == 0);
}

/* Rank `rank`'s gradient views at `step` over `grads` (kCount floats). */
static void make_gradient(int step, int rank, float* grads, zoe_buffer_view* views) {
  size_t i;
  int s;
  uint64_t begin = 0;
  for (i = 0; i < kCount; ++i) grads[i] = gradient(step, rank, i);
  if (step == kNanStep && rank == 1) grads[kCount - 7] = NAN;
  for (s = 0; s < kSegments; ++s) {
    views[s].data = has_gradient(step, rank, s) ? grads + begin : NULL;
    views[s].dtype = ZOE_DTYPE_FLOAT32;
    views[s].count = kSegmentLengths[s];
    begin += kSegmentLengths[s];
  }
}

typedef struct rank_run {
  rank_context context;
  zoe_status status[kSteps + 1]; /* [0]: creation */
  char error[kSteps + 1][256];
  zoe_step_result results[kSteps];
  float params[kSteps][kCount];
  float master[kCount]; /* the shard's master after the last step, at its global offsets */
  int64_t segment_steps[kSegments];
  uint64_t begin, end;
} rank_run;

/* A static object takes a braced list (a compound literal is no constant in C99). */
static const zoe_hyper_params kHyper = {.struct_size = sizeof(zoe_hyper_params),
                                        .lr = 0.01,
                                        .beta1 = 0.9,
                                        .beta2 = 0.999,
                                        .eps = 1e-8,
                                        .weight_decay = 0.01};

static void note(rank_run* run, int slot, zoe_status status) {
  run->status[slot] = status;
  snprintf(run->error[slot], sizeof run->error[slot], "%s", zoe_last_error());
}

static void* run_rank(void* arg) {
  rank_run* run = arg;
  const int rank = run->context.rank;
  char name[32];
  float params[kCount];
  float grads[kCount];
  zoe_buffer_view param_view = {params, ZOE_DTYPE_FLOAT32, kCount};
  zoe_buffer_view grad_views[kSegments];
  zoe_collectives collectives = ZOE_COLLECTIVES_INIT;
  zoe_engine* engine = NULL;
  zoe_sharded_group* group = NULL;
  zoe_group_id local = ZOE_GROUP_ID_INVALID;
  size_t i;
  int step;
  for (i = 0; i < kCount; ++i) params[i] = initial_param(i);
  collectives.context = &run->context;
  collectives.rank = rank;
  collectives.world_size = run->context.comm->world;
  collectives.all_reduce_sum = all_reduce_sum;
  collectives.reduce_scatter_sum = reduce_scatter_sum;
  collectives.all_gather = all_gather;
  collectives.barrier = barrier;
  if (run->context.comm->collectives_kind != kNoBroadcast) collectives.broadcast = broadcast;
  if (run->context.comm->collectives_kind == kBroadcastBeyondSize) {
    collectives.struct_size = offsetof(zoe_collectives, broadcast);
  }
  snprintf(name, sizeof name, "w%d-rank%d-k%d", run->context.comm->world, rank,
           run->context.comm->collectives_kind);
  note(run, 0, create_engine(name, &engine));
  if (run->status[0] == ZOE_OK) {
    note(run, 0, zoe_sharded_group_create(engine, kOptim, &param_view, 1, &collectives, &group));
  }
  if (run->status[0] != ZOE_OK) return NULL; /* every rank fails creation together */
  (void)zoe_sharded_group_local(group, &local, &run->begin, &run->end);
  for (step = 0; step < kSteps; ++step) {
    make_gradient(step, rank, grads, grad_views);
    run->results[step] = ZOE_STEP_RESULT_INIT;
    note(run, step + 1,
         zoe_sharded_step(engine, group, &kHyper, grad_views, kSegments, &param_view, 1, 1.0,
                          &run->results[step]));
    memcpy(run->params[step], params, sizeof params);
  }
  (void)zoe_optim_state_read(engine, local, ZOE_STATE_MASTER, 0, run->end - run->begin,
                             run->master + run->begin);
  (void)zoe_optim_group_segment_steps(engine, local, run->segment_steps, kSegments);
  zoe_sharded_group_destroy(group);
  zoe_engine_destroy(engine);
  return NULL;
}

/* The unsharded group stepped with the average of the `world` ranks' gradients (summed in rank
 * order in fp32, then multiplied by 1/world: what the ranks' reduce-scatter computes). */
typedef struct reference_run {
  zoe_step_result results[kSteps];
  float params[kSteps][kCount];
  float master[kCount];
  int64_t segment_steps[kSegments];
} reference_run;

static void run_reference(int world, reference_run* out) {
  float params[kCount];
  float rank_grads[kCount];
  float average[kCount];
  zoe_buffer_view param_view = {params, ZOE_DTYPE_FLOAT32, kCount};
  zoe_buffer_view views[kSegments];
  zoe_buffer_view rank_views[kSegments];
  zoe_engine* engine = NULL;
  zoe_group_id group = ZOE_GROUP_ID_INVALID;
  char name[32];
  size_t i;
  int step, r, s;
  static int runs = 0; /* each run its own directory */
  for (i = 0; i < kCount; ++i) params[i] = initial_param(i);
  snprintf(name, sizeof name, "reference%d-%d", world, runs++);
  CHECK(create_engine(name, &engine) == ZOE_OK);
  CHECK(zoe_optim_group_create(engine, kOptim, &param_view, 1, &group) == ZOE_OK);
  for (step = 0; step < kSteps; ++step) {
    memset(average, 0, sizeof average);
    for (s = 0; s < kSegments; ++s) views[s] = (zoe_buffer_view){NULL, ZOE_DTYPE_FLOAT32, 0};
    for (r = 0; r < world; ++r) {
      make_gradient(step, r, rank_grads, rank_views);
      for (s = 0; s < kSegments; ++s) views[s].count = rank_views[s].count;
      for (i = 0, s = 0; s < kSegments; i += kSegmentLengths[s], ++s) {
        uint64_t k;
        if (rank_views[s].data == NULL) continue;
        views[s].data = average + i;
        for (k = 0; k < kSegmentLengths[s]; ++k) average[i + k] += rank_grads[i + k];
      }
    }
    for (i = 0; i < kCount; ++i) average[i] *= 1.0f / (float)world;
    out->results[step] = ZOE_STEP_RESULT_INIT;
    CHECK(zoe_optim_step(engine, group, &kHyper, views, kSegments, &param_view, 1, 1.0,
                         &out->results[step]) == ZOE_OK);
    memcpy(out->params[step], params, sizeof params);
  }
  CHECK(zoe_optim_state_read(engine, group, ZOE_STATE_MASTER, 0, kCount, out->master) == ZOE_OK);
  CHECK(zoe_optim_group_segment_steps(engine, group, out->segment_steps, kSegments) == ZOE_OK);
  zoe_engine_destroy(engine);
}

static int close_to(float a, float b) { return fabsf(a - b) <= 1e-5f + 1e-5f * fabsf(b); }

static int all_close(const float* a, const float* b, size_t n) {
  size_t i;
  for (i = 0; i < n; ++i) {
    if (!close_to(a[i], b[i])) {
      fprintf(stderr, "element %zu: %.9g vs %.9g\n", i, a[i], b[i]);
      return 0;
    }
  }
  return 1;
}

/* With kBroadcast the parameters move by the broadcast callback (each rank's part straight into
 * the peers' parameters) instead of the all-gather; the results are the same either way. */
static void test_sharded_equals_unsharded(int world, int collectives_kind) {
  const int broadcasts = collectives_kind == kBroadcast;
  static rank_run runs[kMaxRanks];
  static reference_run reference;
  communicator comm;
  pthread_t threads[kMaxRanks];
  uint64_t begin;
  int r, s, step;
  memset(&comm, 0, sizeof comm);
  comm.world = world;
  comm.collectives_kind = collectives_kind;
  pthread_barrier_init(&comm.barrier, NULL, (unsigned)world);
  for (r = 0; r < world; ++r) {
    memset(&runs[r], 0, sizeof runs[r]);
    runs[r].context.comm = &comm;
    runs[r].context.rank = r;
    CHECK(pthread_create(&threads[r], NULL, run_rank, &runs[r]) == 0);
  }
  for (r = 0; r < world; ++r) pthread_join(threads[r], NULL);
  pthread_barrier_destroy(&comm.barrier);
  /* The parameters of every step but the skipped one moved the way offered, and only so. */
  CHECK(comm.broadcasts == (broadcasts ? kSteps - 1 : 0));
  CHECK(broadcasts ? comm.all_gathers == 0 : comm.all_gathers >= kSteps - 1);
  run_reference(world, &reference);
  for (r = 0; r < world; ++r) {
    const rank_run* run = &runs[r];
    for (step = 0; step <= kSteps; ++step) {
      CHECK(run->status[step] == ZOE_OK);
      if (run->status[step] != ZOE_OK) fprintf(stderr, "rank %d: %s\n", r, run->error[step]);
    }
    /* Uneven shards, cut as documented: [floor(r * n / N), floor((r + 1) * n / N)). */
    CHECK(run->begin == (uint64_t)r * kCount / (uint64_t)world);
    CHECK(run->end == (uint64_t)(r + 1) * kCount / (uint64_t)world);
    for (step = 0; step < kSteps; ++step) {
      const zoe_step_result* got = &run->results[step];
      const zoe_step_result* want = &reference.results[step];
      CHECK(got->skipped == want->skipped);
      CHECK(got->skipped == (step == kNanStep));
      CHECK(fabs(got->grad_norm - want->grad_norm) <= 1e-6 * want->grad_norm ||
            (isinf(got->grad_norm) && isinf(want->grad_norm)));
      CHECK(all_close(run->params[step], reference.params[step], kCount));
    }
    /* Clipping was active: the norm exceeded max_grad_norm on the first step. */
    CHECK(reference.results[0].grad_norm > 0.5);
    /* Each parameter's step count (the skipped step does not count, the absent one only where
     * no rank had a gradient), for the parameters with elements in the shard. */
    for (s = 0, begin = 0; s < kSegments; begin += kSegmentLengths[s], ++s) {
      if (begin + kSegmentLengths[s] <= run->begin || begin >= run->end) continue;
      CHECK(run->segment_steps[s] == reference.segment_steps[s]);
    }
    CHECK(reference.segment_steps[0] == kSteps - 1 && reference.segment_steps[2] == kSteps - 2);
    CHECK(all_close(run->master + run->begin, reference.master + run->begin,
                    (size_t)(run->end - run->begin)));
  }
}

/* A rank whose gradient view has a dtype outside the enum: it fails with INVALID_ARGUMENT naming
 * the view, and its peer, instead of waiting for it, fails with ABORTED naming the rank. */
typedef struct bad_rank_run {
  rank_context context;
  zoe_status status;
  char error[512];
} bad_rank_run;

static void* run_bad_rank(void* arg) {
  bad_rank_run* run = arg;
  const int rank = run->context.rank;
  char name[32];
  float params[kCount];
  float grads[kCount];
  zoe_buffer_view param_view = {params, ZOE_DTYPE_FLOAT32, kCount};
  zoe_buffer_view grad_view = {grads, ZOE_DTYPE_FLOAT32, kCount};
  zoe_collectives collectives = ZOE_COLLECTIVES_INIT;
  zoe_engine* engine = NULL;
  zoe_sharded_group* group = NULL;
  size_t i;
  for (i = 0; i < kCount; ++i) params[i] = initial_param(i);
  for (i = 0; i < kCount; ++i) grads[i] = gradient(0, rank, i);
  collectives.context = &run->context;
  collectives.rank = rank;
  collectives.world_size = run->context.comm->world;
  collectives.all_reduce_sum = all_reduce_sum;
  collectives.reduce_scatter_sum = reduce_scatter_sum;
  collectives.all_gather = all_gather;
  collectives.barrier = barrier;
  snprintf(name, sizeof name, "bad-rank%d", rank);
  run->status = create_engine(name, &engine);
  if (run->status == ZOE_OK) {
    run->status = zoe_sharded_group_create(engine, kOptim, &param_view, 1, &collectives, &group);
  }
  if (run->status == ZOE_OK) {
    if (rank == 1) memset(&grad_view.dtype, 0x7f, sizeof grad_view.dtype);
    run->status =
        zoe_sharded_step(engine, group, &kHyper, &grad_view, 1, &param_view, 1, 1.0, NULL);
  }
  snprintf(run->error, sizeof run->error, "%s", zoe_last_error());
  zoe_sharded_group_destroy(group);
  zoe_engine_destroy(engine);
  return NULL;
}

static void test_bad_view_on_one_rank(void) {
  bad_rank_run runs[2];
  communicator comm;
  pthread_t threads[2];
  int r;
  memset(&comm, 0, sizeof comm);
  memset(runs, 0, sizeof runs);
  comm.world = 2;
  pthread_barrier_init(&comm.barrier, NULL, 2);
  for (r = 0; r < 2; ++r) {
    runs[r].context.comm = &comm;
    runs[r].context.rank = r;
    CHECK(pthread_create(&threads[r], NULL, run_bad_rank, &runs[r]) == 0);
  }
  for (r = 0; r < 2; ++r) pthread_join(threads[r], NULL);
  pthread_barrier_destroy(&comm.barrier);
  CHECK(runs[1].status == ZOE_ERR_INVALID_ARGUMENT);
  CHECK(strstr(runs[1].error, "grads[0].dtype") != NULL);
  CHECK(runs[0].status == ZOE_ERR_ABORTED);
  CHECK(strstr(runs[0].error, "rank(s) 1 gave gradients that cannot be used") != NULL);
  if (runs[0].status != ZOE_ERR_ABORTED) fprintf(stderr, "rank 0: %s\n", runs[0].error);
}

/* Bad collectives are refused before anything is created, naming what is wrong. */
static void test_bad_collectives(void) {
  zoe_engine* engine = NULL;
  zoe_sharded_group* group = (zoe_sharded_group*)1;
  float params[4] = {0};
  zoe_buffer_view view = {params, ZOE_DTYPE_FLOAT32, 4};
  zoe_collectives c = ZOE_COLLECTIVES_INIT;
  CHECK(create_engine("bad", &engine) == ZOE_OK);
  c.rank = 2;
  c.world_size = 2;
  CHECK(zoe_sharded_group_create(engine, "{\"name\": \"b\"}", &view, 1, &c, &group) ==
        ZOE_ERR_INVALID_ARGUMENT);
  CHECK(strstr(zoe_last_error(), "rank 2 of world size 2") != NULL);
  CHECK(group == NULL);
  c.rank = 0;
  CHECK(zoe_sharded_group_create(engine, "{\"name\": \"b\"}", &view, 1, &c, &group) ==
        ZOE_ERR_INVALID_ARGUMENT);
  CHECK(strstr(zoe_last_error(), "collectives->all_reduce_sum is NULL") != NULL);
  CHECK(zoe_sharded_group_create(engine, "{\"name\": \"b\"}", &view, 1, NULL, &group) ==
        ZOE_ERR_INVALID_ARGUMENT);
  CHECK(zoe_sharded_step(engine, NULL, NULL, NULL, 0, NULL, 0, 1.0, NULL) ==
        ZOE_ERR_INVALID_ARGUMENT);
  zoe_sharded_group_destroy(NULL);
  zoe_engine_destroy(engine);
}

/* Without NCCL the helper says so; with it, a NULL communicator is refused. Neither leaves a
 * context to release. */
static void test_nccl_helper_without_communicator(void) {
  zoe_collectives c = ZOE_COLLECTIVES_INIT;
  const zoe_status status = zoe_nccl_collectives_create(NULL, NULL, &c);
  CHECK(status == ZOE_ERR_NOT_SUPPORTED || status == ZOE_ERR_INVALID_ARGUMENT);
  CHECK(c.context == NULL);
  zoe_nccl_collectives_destroy(&c);
  zoe_nccl_collectives_destroy(NULL);
}

/* zoe_shard_range: the shards tile [0, count) in order, differ in size by at most one element,
 * follow floor(r * count / world) where that fits in 64 bits and do not overflow where it does
 * not; bad ranks, world sizes and NULL outputs are refused. */
static void test_shard_range(void) {
  static const uint64_t counts[] = {0, 1, 7, 1001, UINT64_MAX};
  for (size_t c = 0; c < sizeof counts / sizeof counts[0]; ++c) {
    for (int32_t world = 1; world <= 5; ++world) {
      uint64_t expected_begin = 0;
      for (int32_t rank = 0; rank < world; ++rank) {
        uint64_t begin = 1, end = 0;
        CHECK(zoe_shard_range(counts[c], rank, world, &begin, &end) == ZOE_OK);
        CHECK(begin == expected_begin);
        CHECK(end >= begin && end - begin >= counts[c] / (uint64_t)world);
        CHECK(end - begin - counts[c] / (uint64_t)world <= 1);
        if (counts[c] < (UINT64_MAX >> 8)) CHECK(end == (uint64_t)(rank + 1) * counts[c] / world);
        expected_begin = end;
      }
      CHECK(expected_begin == counts[c]);
    }
  }
  /* A failure leaves 0 in both outputs given (zoe.h, convention 6). */
  uint64_t begin = 7, end = 7;
  CHECK(zoe_shard_range(10, 2, 2, &begin, &end) == ZOE_ERR_INVALID_ARGUMENT);
  CHECK(strstr(zoe_last_error(), "rank 2 of world size 2") != NULL);
  CHECK(begin == 0 && end == 0);
  begin = end = 7;
  CHECK(zoe_shard_range(10, 5, 3, &begin, &end) == ZOE_ERR_INVALID_ARGUMENT);
  CHECK(begin == 0 && end == 0);
  CHECK(zoe_shard_range(10, -1, 2, &begin, &end) == ZOE_ERR_INVALID_ARGUMENT);
  CHECK(zoe_shard_range(10, 0, 0, &begin, &end) == ZOE_ERR_INVALID_ARGUMENT);
  end = 7;
  CHECK(zoe_shard_range(10, 0, 1, NULL, &end) == ZOE_ERR_INVALID_ARGUMENT);
  CHECK(end == 0);
  begin = 7;
  CHECK(zoe_shard_range(10, 0, 1, &begin, NULL) == ZOE_ERR_INVALID_ARGUMENT);
  CHECK(begin == 0);
}

/* zoe_sharded_group_local on a NULL group: INVALID_ARGUMENT, and the outputs given are
 * ZOE_GROUP_ID_INVALID and 0 (zoe.h, convention 6). */
static void test_sharded_group_local_failure_clears_outputs(void) {
  zoe_group_id id = 5;
  uint64_t begin = 7, end = 7;
  CHECK(zoe_sharded_group_local(NULL, &id, &begin, &end) == ZOE_ERR_INVALID_ARGUMENT);
  CHECK(strstr(zoe_last_error(), "group is NULL") != NULL);
  CHECK(id == ZOE_GROUP_ID_INVALID && begin == 0 && end == 0);
}

int main(void) {
  const char* base = getenv("TMPDIR");
  snprintf(root, sizeof root, "%s/zoe-shard-XXXXXX", base != NULL && *base ? base : "/tmp");
  if (mkdtemp(root) == NULL) {
    perror("mkdtemp");
    return 1;
  }
  test_sharded_equals_unsharded(2, kNoBroadcast);
  test_sharded_equals_unsharded(3, kNoBroadcast);
  test_sharded_equals_unsharded(2, kBroadcast);
  test_sharded_equals_unsharded(3, kBroadcast);
  test_sharded_equals_unsharded(2, kBroadcastBeyondSize);
  test_bad_view_on_one_rank();
  test_bad_collectives();
  test_nccl_helper_without_communicator();
  test_shard_range();
  test_sharded_group_local_failure_clears_outputs();
  nftw(root, remove_entry, 16, FTW_DEPTH | FTW_PHYS);
  return finish_checks();
}
