/* Description: structs that carry their size (zoe.h, convention 8), from plain C: a caller built
 * against an older, smaller layout (inputs read with defaults for the members it lacks, outputs
 * written only as far as its struct_size), one built against a newer, larger layout (accepted
 * when the unknown bytes are zero, refused naming the struct and both sizes otherwise), and
 * struct_size 0. The old and new layouts are declared here, as such callers would have them. */
#define _XOPEN_SOURCE 700
#include <ftw.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "capi_check.h"
#include "zoe.h"

#define CHECK_OK(call)                                                             \
  do {                                                                             \
    zoe_status status_ = (call);                                                   \
    CHECK(status_ == ZOE_OK);                                                      \
    if (status_ != ZOE_OK) fprintf(stderr, "  %s: %s\n", #call, zoe_last_error()); \
  } while (0)

/* Fails with INVALID_ARGUMENT and a message containing every one of the NULL-ended needles. */
static void check_refused(zoe_status status, const char* const* needles, int line) {
  const char* message = zoe_last_error();
  int i;
  CHECK(status == ZOE_ERR_INVALID_ARGUMENT);
  for (i = 0; needles[i] != NULL; ++i) {
    CHECK(strstr(message, needles[i]) != NULL);
    if (strstr(message, needles[i]) == NULL)
      fprintf(stderr, "  line %d: '%s' not in '%s'\n", line, needles[i], message);
  }
}
#define CHECK_REFUSED(call, ...)                        \
  do {                                                  \
    const char* const needles_[] = {__VA_ARGS__, NULL}; \
    check_refused((call), needles_, __LINE__);          \
  } while (0)

enum { kParams = 64 };

/* ---- layouts of other versions of zoe.h ---------------------------------------------------- */

/* An older zoe.h: zoe_hyper_params had only lr, zoe_tensor_desc no dtype, home or group,
 * zoe_step_result stopped after grad_norm and zoe_speculation_stats after steps. */
typedef struct old_hyper_params {
  size_t struct_size;
  double lr;
} old_hyper_params;

typedef struct old_tensor_desc {
  size_t struct_size;
  const char* name;
  uint64_t bytes;
} old_tensor_desc;

typedef struct old_step_result {
  size_t struct_size;
  int32_t skipped;
  double grad_norm;
} old_step_result;

typedef struct old_speculation_stats {
  size_t struct_size;
  uint64_t steps;
} old_speculation_stats;

/* A newer zoe.h: each struct gained a member at its end. */
typedef struct new_hyper_params {
  size_t struct_size;
  double lr, beta1, beta2, eps, weight_decay;
  double future; /* unknown to this library */
} new_hyper_params;

typedef struct new_step_result {
  size_t struct_size;
  int32_t skipped;
  double grad_norm;
  int64_t steps_taken;
  uint64_t bytes_read, bytes_written;
  double seconds;
  uint64_t future; /* unknown to this library */
} new_step_result;

/* An older output struct inside a larger object, to see that zoe writes nothing past it. */
typedef struct guarded_result {
  old_step_result result;
  unsigned char after[32];
} guarded_result;

/* ---- fixture ------------------------------------------------------------------------------- */

static char root[256];
static char config[1024];
static float params[kParams];
static float grads[kParams];

static int remove_entry(const char* path, const struct stat* st, int flag, struct FTW* ftw) {
  (void)st;
  (void)flag;
  (void)ftw;
  return remove(path);
}

static zoe_engine* create_engine(void) {
  zoe_engine* engine = NULL;
  CHECK_OK(zoe_engine_create(config, &engine));
  return engine;
}

static zoe_buffer_view view_of(float* data, uint64_t count) {
  zoe_buffer_view view;
  view.data = data;
  view.dtype = ZOE_DTYPE_FLOAT32;
  view.count = count;
  return view;
}

static zoe_group_id create_group(zoe_engine* engine, const char* json) {
  zoe_buffer_view view = view_of(params, kParams);
  zoe_group_id id = ZOE_GROUP_ID_INVALID;
  int i;
  for (i = 0; i < kParams; ++i) params[i] = 0.5f + 0.01f * (float)i;
  CHECK_OK(zoe_optim_group_create(engine, json, &view, 1, &id));
  return id;
}

/* ---- an older caller --------------------------------------------------------------------- */

/* hyper with only lr steps exactly as the full struct with lr and every other member at its
 * ZOE_HYPER_PARAMS_INIT default; step_result gets skipped and grad_norm, nothing after them. */
static void test_older_caller(void) {
  zoe_engine* engine = create_engine();
  static float old_out[kParams];
  static float full_out[kParams];
  zoe_buffer_view grad_view = view_of(grads, kParams);
  zoe_buffer_view out_view;
  old_hyper_params old_hyper;
  zoe_hyper_params full_hyper = ZOE_HYPER_PARAMS_INIT;
  zoe_step_result full_result = ZOE_STEP_RESULT_INIT;
  guarded_result guarded;
  zoe_group_id a, b;
  int i, same = 1, moved = 1;
  if (engine == NULL) return;
  for (i = 0; i < kParams; ++i) grads[i] = (i % 2 == 0 ? 1.0f : -1.0f) * 0.01f;
  old_hyper.struct_size = sizeof old_hyper;
  old_hyper.lr = 0.05;
  full_hyper.lr = 0.05;
  memset(&guarded, 0xab, sizeof guarded);
  guarded.result.struct_size = sizeof guarded.result;
  a = create_group(engine, "{\"name\": \"a\", \"lr\": 0.5, \"betas\": [0.5, 0.5]}");
  b = create_group(engine, "{\"name\": \"b\", \"lr\": 0.5, \"betas\": [0.5, 0.5]}");
  out_view = view_of(old_out, kParams);
  CHECK_OK(zoe_optim_step(engine, a, (const zoe_hyper_params*)&old_hyper, &grad_view, 1, &out_view,
                          1, 1.0, (zoe_step_result*)&guarded.result));
  out_view = view_of(full_out, kParams);
  CHECK_OK(zoe_optim_step(engine, b, &full_hyper, &grad_view, 1, &out_view, 1, 1.0, &full_result));
  for (i = 0; i < kParams; ++i) {
    same = same && old_out[i] == full_out[i];
    /* The first AdamW step moves each weight by about lr: lr 0.05 was read. */
    moved = moved && fabs(fabs(old_out[i] - params[i]) - 0.05) < 1e-4;
  }
  CHECK(same);
  CHECK(moved);
  CHECK(guarded.result.struct_size == sizeof(old_step_result));
  CHECK(guarded.result.skipped == 0);
  CHECK(guarded.result.grad_norm == full_result.grad_norm && full_result.grad_norm > 0.0);
  for (i = 0; i < (int)sizeof guarded.after; ++i) CHECK(guarded.after[i] == 0xab);
  zoe_engine_destroy(engine);
}

/* A tensor_desc without dtype, home and group registers as FLOAT32 homed on NVMe in the default
 * group; speculation_stats with only steps gets steps. */
static void test_older_caller_desc_and_stats(void) {
  zoe_engine* engine = create_engine();
  old_tensor_desc desc;
  zoe_tensor_id id = ZOE_TENSOR_ID_INVALID, found = ZOE_TENSOR_ID_INVALID;
  struct {
    old_speculation_stats stats;
    uint64_t after;
  } guarded;
  zoe_group_id g;
  if (engine == NULL) return;
  desc.struct_size = sizeof desc;
  desc.name = "old";
  desc.bytes = 4096;
  CHECK_OK(zoe_tensor_register(engine, (const zoe_tensor_desc*)&desc, &id));
  CHECK_OK(zoe_tensor_find(engine, "old", &found));
  CHECK(id != ZOE_TENSOR_ID_INVALID && found == id);
  desc.bytes = 6; /* the default dtype FLOAT32 was applied: 6 is no multiple of 4 */
  desc.name = "odd";
  CHECK_REFUSED(zoe_tensor_register(engine, (const zoe_tensor_desc*)&desc, &id), "odd");
  g = create_group(engine, "{\"name\": \"s\"}");
  guarded.stats.struct_size = sizeof guarded.stats;
  guarded.stats.steps = 99;
  guarded.after = 77;
  CHECK_OK(zoe_optim_group_speculation_stats(engine, g, (zoe_speculation_stats*)&guarded.stats));
  CHECK(guarded.stats.steps == 0 && guarded.after == 77);
  zoe_engine_destroy(engine);
}

/* ---- a newer caller ---------------------------------------------------------------------- */

static void test_newer_caller(void) {
  zoe_engine* engine = create_engine();
  zoe_buffer_view grad_view = view_of(grads, kParams);
  new_hyper_params hyper;
  new_step_result result;
  zoe_group_id g;
  char size_text[64], known_text[64];
  int i;
  if (engine == NULL) return;
  for (i = 0; i < kParams; ++i) grads[i] = 0.01f;
  memset(&hyper, 0, sizeof hyper);
  hyper.struct_size = sizeof hyper;
  hyper.lr = 0.01;
  hyper.beta1 = 0.9;
  hyper.beta2 = 0.999;
  hyper.eps = 1e-8;
  memset(&result, 0, sizeof result);
  result.struct_size = sizeof result;
  g = create_group(engine, "{\"name\": \"n\"}");
  /* Unknown members left zero: accepted, and the unknown output member stays zero. */
  CHECK_OK(zoe_optim_step(engine, g, (const zoe_hyper_params*)&hyper, &grad_view, 1, NULL, 0, 1.0,
                          (zoe_step_result*)&result));
  CHECK(result.steps_taken == 1 && result.grad_norm > 0.0 && result.future == 0);
  CHECK(result.struct_size == sizeof result);

  /* An unknown input member set: refused, naming the struct, its size and the size known. */
  snprintf(size_text, sizeof size_text, "struct_size = %zu", sizeof hyper);
  snprintf(known_text, sizeof known_text, "%zu bytes", sizeof(zoe_hyper_params));
  hyper.future = 1.0;
  result.grad_norm = -1.0;
  CHECK_REFUSED(zoe_optim_step(engine, g, (const zoe_hyper_params*)&hyper, &grad_view, 1, NULL, 0,
                               1.0, (zoe_step_result*)&result),
                "hyper", "zoe_hyper_params", size_text, known_text);
  CHECK(result.grad_norm == 0.0); /* a refused call still clears the output it accepted */
  hyper.future = 0.0;

  /* An unknown output member set: refused, and the struct is not written. */
  snprintf(size_text, sizeof size_text, "struct_size = %zu", sizeof result);
  snprintf(known_text, sizeof known_text, "%zu bytes", sizeof(zoe_step_result));
  result.future = 5;
  result.grad_norm = -1.0;
  CHECK_REFUSED(zoe_optim_step(engine, g, (const zoe_hyper_params*)&hyper, &grad_view, 1, NULL, 0,
                               1.0, (zoe_step_result*)&result),
                "out", "zoe_step_result", size_text, known_text);
  CHECK(result.grad_norm == -1.0 && result.future == 5);
  zoe_engine_destroy(engine);
}

/* ---- struct_size 0 and other sizes below the first version ----------------------------- */

static void test_size_below_minimum(void) {
  zoe_engine* engine = create_engine();
  zoe_tensor_desc desc = ZOE_TENSOR_DESC_INIT;
  zoe_hyper_params hyper = ZOE_HYPER_PARAMS_INIT;
  zoe_step_result result = ZOE_STEP_RESULT_INIT;
  zoe_speculation_stats stats = ZOE_SPECULATION_STATS_INIT;
  zoe_collectives collectives = ZOE_COLLECTIVES_INIT;
  zoe_sharded_group* sharded = NULL;
  zoe_buffer_view view = view_of(params, kParams);
  zoe_tensor_id id = 0;
  zoe_group_id g;
  if (engine == NULL) return;
  g = create_group(engine, "{\"name\": \"z\"}");
  desc.name = "zero";
  desc.bytes = 4096;
  desc.struct_size = 0;
  CHECK_REFUSED(zoe_tensor_register(engine, &desc, &id), "desc", "zoe_tensor_desc.struct_size = 0",
                "smaller than 8", "40 bytes");
  CHECK(id == ZOE_TENSOR_ID_INVALID);
  desc.struct_size = 4;
  CHECK_REFUSED(zoe_tensor_register(engine, &desc, &id), "zoe_tensor_desc.struct_size = 4");
  hyper.struct_size = 0;
  CHECK_REFUSED(zoe_optim_step(engine, g, &hyper, NULL, 0, NULL, 0, 1.0, NULL),
                "hyper: zoe_hyper_params.struct_size = 0");
  result.struct_size = 0;
  CHECK_REFUSED(zoe_optim_step(engine, g, NULL, NULL, 0, NULL, 0, 1.0, &result),
                "out: zoe_step_result.struct_size = 0");
  stats.struct_size = 0;
  CHECK_REFUSED(zoe_optim_group_speculation_stats(engine, g, &stats),
                "zoe_speculation_stats.struct_size = 0");
  collectives.struct_size = 0;
  CHECK_REFUSED(
      zoe_sharded_group_create(engine, "{\"name\": \"c\"}", &view, 1, &collectives, &sharded),
      "collectives: zoe_collectives.struct_size = 0");
  CHECK(sharded == NULL);
  /* Collectives zoe fills must have room for every member; refused before NCCL is looked for. */
  collectives.struct_size = sizeof(size_t) + sizeof(void*);
  CHECK_REFUSED(zoe_nccl_collectives_create(NULL, NULL, &collectives), "zoe_collectives",
                "allowed: at least 56");
  zoe_nccl_collectives_destroy(&collectives);
  /* With only struct_size, every member of an input takes its default: a NULL name. */
  desc.struct_size = sizeof(size_t);
  CHECK_REFUSED(zoe_tensor_register(engine, &desc, &id), "desc->name is NULL");
  zoe_engine_destroy(engine);
}

int main(void) {
  const char* base = getenv("TMPDIR");
  snprintf(root, sizeof root, "%s/zoe-sized-XXXXXX", base != NULL && *base ? base : "/tmp");
  if (mkdtemp(root) == NULL) {
    perror("mkdtemp");
    return 1;
  }
  snprintf(config, sizeof config,
           "{\"zero_optimization\": {\"offload_optimizer\": {\"device\": \"nvme\","
           " \"nvme_path\": \"%s\"}},"
           " \"zoe\": {\"chunk_size\": 65536, \"host_budget\": \"64M\","
           " \"tensor_host_budget\": 262144, \"tensor_swap_bytes\": \"4M\", \"device\": \"host\","
           " \"device_budget\": 131072}}",
           root);
  test_older_caller();
  test_older_caller_desc_and_stats();
  test_newer_caller();
  test_size_below_minimum();
  nftw(root, remove_entry, 16, FTW_DEPTH | FTW_PHYS);
  return finish_checks();
}
