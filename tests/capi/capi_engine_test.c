/* Description: the engine through the C API from plain C: create with a configuration, tensors
 * (register, acquire, write, release, evict, read back), traces, optimizer groups (steps, state,
 * step counts, segments and absent gradients, checkpoints), statistics and configuration as JSON,
 * and every error path a C caller can reach (NULL arguments, enum values out of range, bad
 * configuration keys, unknown ids, wrong dtypes and sizes, calls in the wrong order). */
#define _XOPEN_SOURCE 700
#include <ftw.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "capi_check.h"
#include "zoe.h"

/* A call that must succeed; prints zoe_last_error() when it does not. */
#define CHECK_OK(call)                                                         \
  do {                                                                         \
    zoe_status status_ = (call);                                               \
    ++checks;                                                                  \
    if (status_ != ZOE_OK) {                                                   \
      ++failures;                                                              \
      fprintf(stderr, "%s:%d: %s failed: %s: %s\n", __FILE__, __LINE__, #call, \
              zoe_status_string(status_), zoe_last_error());                   \
    }                                                                          \
  } while (0)

/* A call that must fail with `expected` and a message containing `needle`. */
#define CHECK_FAILS(call, expected, needle)                                                       \
  do {                                                                                            \
    zoe_status status_ = (call);                                                                  \
    ++checks;                                                                                     \
    if (status_ != (expected) || strstr(zoe_last_error(), (needle)) == NULL) {                    \
      ++failures;                                                                                 \
      fprintf(stderr, "%s:%d: %s gave %s (%s), wanted %s with '%s'\n", __FILE__, __LINE__, #call, \
              zoe_status_string(status_), zoe_last_error(), zoe_status_string(expected),          \
              (needle));                                                                          \
    }                                                                                             \
  } while (0)

enum { kChunk = 64 * 1024, kTensorBytes = 16 * 1024, kParams = 1000, kSubGroup = 256 };

static char root[256]; /* this test's temporary directory */
static char nvme[300]; /* swap directory inside it */
static char config[1024];

static int remove_entry(const char* path, const struct stat* st, int flag, struct FTW* ftw) {
  (void)st;
  (void)flag;
  (void)ftw;
  return remove(path);
}

static int make_dirs(void) {
  const char* base = getenv("TMPDIR");
  snprintf(root, sizeof root, "%s/zoe-capi-XXXXXX", base != NULL && *base ? base : "/tmp");
  if (mkdtemp(root) == NULL) return 0;
  snprintf(nvme, sizeof nvme, "%s/nvme", root);
  return mkdir(nvme, 0700) == 0;
}

/* HOST holds four chunks for tensors; the optimizer state goes to NVMe in sub-groups of 256. */
static void make_config(void) {
  snprintf(config, sizeof config,
           "{\"zero_optimization\": {\"sub_group_size\": %d,"
           " \"offload_optimizer\": {\"device\": \"nvme\", \"nvme_path\": \"%s\"}},"
           " \"zoe\": {\"chunk_size\": %d, \"host_budget\": \"64M\","
           " \"tensor_host_budget\": %d, \"tensor_swap_bytes\": \"4M\", \"device\": \"host\","
           " \"device_budget\": %d}}",
           kSubGroup, nvme, kChunk, 4 * kChunk, 2 * kChunk);
}

static zoe_engine* create_engine(void) {
  zoe_engine* engine = NULL;
  CHECK_OK(zoe_engine_create(config, &engine));
  CHECK(engine != NULL);
  return engine;
}

static void fill(unsigned char* bytes, size_t n, unsigned seed) {
  size_t i;
  for (i = 0; i < n; ++i) bytes[i] = (unsigned char)((i * 31u + seed * 7u) & 0xff);
}

static zoe_tensor_id register_tensor(zoe_engine* engine, const char* name, zoe_tier home) {
  zoe_tensor_desc desc = ZOE_TENSOR_DESC_INIT;
  zoe_tensor_id id = ZOE_TENSOR_ID_INVALID;
  desc.name = name;
  desc.bytes = kTensorBytes;
  desc.dtype = ZOE_DTYPE_FLOAT32;
  desc.home = home;
  desc.group = NULL;
  CHECK_OK(zoe_tensor_register(engine, &desc, &id));
  return id;
}

/* ---- engine ------------------------------------------------------------------------------ */

static void test_create_and_json(void) {
  zoe_engine* engine = create_engine();
  char* json = NULL;
  CHECK(strcmp(zoe_last_error(), "") == 0);
  CHECK_OK(zoe_engine_config_json(engine, &json));
  CHECK(json != NULL && strstr(json, nvme) != NULL);
  CHECK(json != NULL && strstr(json, "\"sub_group_size\":256") != NULL);
  zoe_free(json);
  json = NULL;
  CHECK_OK(zoe_engine_stats_json(engine, &json));
  CHECK(json != NULL && strstr(json, "\"links\"") != NULL);
  CHECK(json != NULL && strstr(json, "\"io_backend\"") != NULL);
  CHECK(json != NULL && strstr(json, "\"groups\":[]") != NULL);
  zoe_free(json);
  CHECK_OK(zoe_engine_async_error(engine));
  CHECK_OK(zoe_engine_flush(engine));
  zoe_engine_destroy(engine);
  zoe_engine_destroy(NULL);
}

static void test_create_errors(void) {
  zoe_engine* engine = (zoe_engine*)&engine; /* a non-NULL value the failure must clear */
  CHECK_FAILS(zoe_engine_create("{\"zoe\": {\"chunk_sise\": 65536}}", &engine),
              ZOE_ERR_INVALID_ARGUMENT, "did you mean 'chunk_size'?");
  CHECK(engine == NULL);
  CHECK_FAILS(zoe_engine_create("{\"zoe\": ", &engine), ZOE_ERR_INVALID_ARGUMENT, "");
  CHECK_FAILS(zoe_engine_create("{}", NULL), ZOE_ERR_INVALID_ARGUMENT, "out is NULL");
  /* A missing swap directory is created; one under a file cannot be. */
  CHECK_FAILS(zoe_engine_create("{\"zoe\": {\"nvme_paths\": \"/dev/null/zoe\"}}", &engine),
              ZOE_ERR_NOT_FOUND, "/dev/null/zoe");
  CHECK(engine == NULL);
  CHECK_FAILS(zoe_engine_flush(NULL), ZOE_ERR_INVALID_ARGUMENT, "engine is NULL");
  CHECK_FAILS(zoe_engine_async_error(NULL), ZOE_ERR_INVALID_ARGUMENT, "engine is NULL");
  CHECK_FAILS(zoe_engine_stats_json(NULL, NULL), ZOE_ERR_INVALID_ARGUMENT, "out_json is NULL");
  CHECK_FAILS(zoe_engine_config_json(NULL, NULL), ZOE_ERR_INVALID_ARGUMENT, "out_json is NULL");
}

/* A configuration read without an engine: zoe_engine_create's errors of reading, nothing created
 * (a swap directory that cannot exist is not looked at), the warnings handed back. */
static void test_config_check(void) {
  char* warnings = (char*)&warnings; /* a non-NULL value a failure must clear */
  CHECK_OK(zoe_config_check(NULL, NULL));
  CHECK_OK(zoe_config_check("", &warnings));
  CHECK(warnings != NULL && strcmp(warnings, "[]") == 0);
  zoe_free(warnings);
  CHECK_OK(
      zoe_config_check("{\"zero_optimization\": {\"stage\": 2, \"offload_param\": "
                       "{\"device\": \"cpu\"}}, \"zoe\": {\"nvme_paths\": \"/dev/null/z\"}}",
                       &warnings));
  CHECK(warnings != NULL && strstr(warnings, "offload_param") != NULL);
  zoe_free(warnings);
  CHECK_FAILS(zoe_config_check("{\"zoe\": {\"chunk_sise\": 65536}}", &warnings),
              ZOE_ERR_INVALID_ARGUMENT, "did you mean 'chunk_size'?");
  CHECK(warnings == NULL);
  CHECK_FAILS(zoe_config_check("{\"zero_optimisation\": {}}", NULL), ZOE_ERR_INVALID_ARGUMENT,
              "did you mean 'zero_optimization'?");
  CHECK_FAILS(zoe_config_check("{\"zoe\": {\"log_level\": \"loud\"}}", NULL),
              ZOE_ERR_INVALID_ARGUMENT, "log_level");
  CHECK_FAILS(zoe_config_check("{\"zoe\": ", NULL), ZOE_ERR_INVALID_ARGUMENT, "");
}

/* A DeepSpeed document with its pydantic sections read as pydantic reads them, for a framework
 * that reads the rest itself: quoted values converted, the deprecated offload switch mapped,
 * "auto", other sections and non-finite numbers handed back as given. */
static void test_config_normalize(void) {
  char* out = (char*)&out; /* a non-NULL value a failure must clear */
  CHECK_OK(zoe_config_normalize(NULL, &out));
  CHECK(strcmp(out, "{}") == 0);
  zoe_free(out);
  CHECK_OK(zoe_config_normalize(
      "{\"zero_optimization\": {\"stage\": \"2\", \"cpu_offload\": \"yes\", \"sub_group_size\": "
      "\"auto\"}, \"fp16\": {\"enabled\": \"auto\", \"hysteresis\": \" 2 \"}, "
      "\"steps_per_print\": Infinity, \"gradient_clipping\": \"1.0\"}",
      &out));
  CHECK(strcmp(out,
               "{\"fp16\":{\"enabled\":\"auto\",\"hysteresis\":2},\"gradient_clipping\":\"1.0\","
               "\"steps_per_print\":Infinity,\"zero_optimization\":{\"offload_optimizer\":"
               "{\"device\":\"cpu\"},\"stage\":2,\"sub_group_size\":\"auto\"}}") == 0);
  zoe_free(out);
  out = (char*)&out;
  CHECK_FAILS(zoe_config_normalize("{\"bf16\": {\"enabled\": \"maybe\"}}", &out),
              ZOE_ERR_INVALID_ARGUMENT, "bf16.enabled = \"maybe\" is not allowed");
  CHECK(out == NULL);
  CHECK_FAILS(zoe_config_normalize("{\"zero_optimization\": ", &out), ZOE_ERR_INVALID_ARGUMENT, "");
  CHECK(out == NULL);
  CHECK_FAILS(zoe_config_normalize("{}", NULL), ZOE_ERR_INVALID_ARGUMENT, "out_json is NULL");
}

/* An empty configuration works too: the tensors swap to a private temporary directory. */
static void test_default_config(void) {
  zoe_engine* engine = NULL;
  zoe_tensor_id id = ZOE_TENSOR_ID_INVALID;
  void* ptr = NULL;
  CHECK_OK(zoe_engine_create(NULL, &engine));
  if (engine == NULL) return;
  id = register_tensor(engine, "w", ZOE_TIER_NVME);
  CHECK_OK(zoe_tensor_acquire(engine, id, ZOE_TIER_HOST, ZOE_ACCESS_READ, &ptr));
  CHECK(ptr != NULL && ((const unsigned char*)ptr)[kTensorBytes - 1] == 0);
  CHECK_OK(zoe_tensor_release(engine, id));
  zoe_engine_destroy(engine);
}

/* ---- tensors ----------------------------------------------------------------------------- */

static void test_tensor_round_trip(void) {
  zoe_engine* engine = create_engine();
  unsigned char expected[kTensorBytes];
  zoe_tensor_id ids[8];
  zoe_tensor_id found = ZOE_TENSOR_ID_INVALID;
  char name[16];
  void* ptr = NULL;
  int i;
  if (engine == NULL) return;
  /* Eight tensors of a quarter chunk each, in their own runs: more than HOST can hold. */
  for (i = 0; i < 8; ++i) {
    snprintf(name, sizeof name, "t%d", i);
    ids[i] = register_tensor(engine, name, ZOE_TIER_NVME);
  }
  CHECK_OK(zoe_tensor_find(engine, "t3", &found));
  CHECK(found == ids[3]);
  for (i = 0; i < 8; ++i) {
    CHECK_OK(zoe_tensor_acquire(engine, ids[i], ZOE_TIER_HOST, ZOE_ACCESS_WRITE, &ptr));
    if (ptr != NULL) fill((unsigned char*)ptr, kTensorBytes, (unsigned)i);
    CHECK_OK(zoe_tensor_release(engine, ids[i]));
    CHECK_OK(zoe_tensor_evict(engine, ids[i]));
  }
  for (i = 0; i < 8; ++i) {
    ptr = NULL;
    fill(expected, kTensorBytes, (unsigned)i);
    CHECK_OK(zoe_tensor_acquire(engine, ids[i], ZOE_TIER_HOST, ZOE_ACCESS_READ, &ptr));
    CHECK(ptr != NULL && memcmp(ptr, expected, kTensorBytes) == 0);
    CHECK_OK(zoe_tensor_release(engine, ids[i]));
  }
  /* The device tier (the host stand-in here) hands out its own copy of the same bytes. */
  ptr = NULL;
  fill(expected, kTensorBytes, 5u);
  CHECK_OK(zoe_tensor_acquire(engine, ids[5], ZOE_TIER_DEVICE, ZOE_ACCESS_READ, &ptr));
  CHECK(ptr != NULL && memcmp(ptr, expected, kTensorBytes) == 0);
  CHECK_OK(zoe_tensor_release(engine, ids[5]));
  CHECK_OK(zoe_tensor_prefetch(engine, ids[0], ZOE_TIER_HOST));
  CHECK_OK(zoe_engine_flush(engine));
  CHECK_OK(zoe_engine_async_error(engine));
  zoe_engine_destroy(engine);
}

static void test_tensor_errors(void) {
  zoe_engine* engine = create_engine();
  zoe_tensor_desc desc = ZOE_TENSOR_DESC_INIT;
  zoe_tensor_id id = 0;
  zoe_tensor_id w;
  void* ptr = &ptr;
  if (engine == NULL) return;
  w = register_tensor(engine, "w", ZOE_TIER_HOST);
  desc.name = "x";
  desc.bytes = 6;
  desc.dtype = ZOE_DTYPE_FLOAT32;
  desc.home = ZOE_TIER_HOST;
  desc.group = "";
  CHECK_FAILS(zoe_tensor_register(engine, &desc, &id), ZOE_ERR_INVALID_ARGUMENT, "6 bytes");
  CHECK(id == ZOE_TENSOR_ID_INVALID);
  desc.bytes = 8;
  desc.dtype = (zoe_dtype)42;
  CHECK_FAILS(zoe_tensor_register(engine, &desc, &id), ZOE_ERR_INVALID_ARGUMENT,
              "desc->dtype = 42");
  desc.dtype = ZOE_DTYPE_FLOAT32;
  desc.home = (zoe_tier)3;
  CHECK_FAILS(zoe_tensor_register(engine, &desc, &id), ZOE_ERR_INVALID_ARGUMENT, "desc->home = 3");
  desc.home = ZOE_TIER_HOST;
  desc.name = NULL;
  CHECK_FAILS(zoe_tensor_register(engine, &desc, &id), ZOE_ERR_INVALID_ARGUMENT,
              "desc->name is NULL");
  desc.name = "w";
  CHECK_FAILS(zoe_tensor_register(engine, &desc, &id), ZOE_ERR_INVALID_ARGUMENT,
              "already registered");
  CHECK_FAILS(zoe_tensor_register(engine, NULL, &id), ZOE_ERR_INVALID_ARGUMENT, "desc is NULL");
  CHECK_FAILS(zoe_tensor_register(engine, &desc, NULL), ZOE_ERR_INVALID_ARGUMENT, "out is NULL");
  CHECK_FAILS(zoe_tensor_register(NULL, &desc, &id), ZOE_ERR_INVALID_ARGUMENT, "engine is NULL");
  CHECK_FAILS(zoe_tensor_find(engine, "nope", &id), ZOE_ERR_NOT_FOUND, "nope");
  CHECK(id == ZOE_TENSOR_ID_INVALID);
  CHECK_FAILS(zoe_tensor_find(engine, NULL, &id), ZOE_ERR_INVALID_ARGUMENT, "name is NULL");

  CHECK_FAILS(zoe_tensor_acquire(engine, 999, ZOE_TIER_HOST, ZOE_ACCESS_READ, &ptr),
              ZOE_ERR_NOT_FOUND, "999");
  CHECK(ptr == NULL);
  CHECK_FAILS(zoe_tensor_acquire(engine, w, (zoe_tier)7, ZOE_ACCESS_READ, &ptr),
              ZOE_ERR_INVALID_ARGUMENT, "tier = 7");
  CHECK_FAILS(zoe_tensor_acquire(engine, w, ZOE_TIER_HOST, (zoe_access)9, &ptr),
              ZOE_ERR_INVALID_ARGUMENT, "access = 9");
  CHECK_FAILS(zoe_tensor_acquire(engine, w, ZOE_TIER_NVME, ZOE_ACCESS_READ, &ptr),
              ZOE_ERR_INVALID_ARGUMENT, "");
  CHECK_FAILS(zoe_tensor_acquire(engine, w, ZOE_TIER_HOST, ZOE_ACCESS_READ, NULL),
              ZOE_ERR_INVALID_ARGUMENT, "out_ptr is NULL");
  CHECK_FAILS(zoe_tensor_release(engine, w), ZOE_ERR_FAILED_PRECONDITION, "");
  CHECK_FAILS(zoe_tensor_release(engine, 999), ZOE_ERR_NOT_FOUND, "");
  CHECK_FAILS(zoe_tensor_prefetch(engine, 999, ZOE_TIER_HOST), ZOE_ERR_NOT_FOUND, "");
  CHECK_FAILS(zoe_tensor_prefetch(engine, w, (zoe_tier)-1), ZOE_ERR_INVALID_ARGUMENT, "tier = -1");
  CHECK_FAILS(zoe_tensor_evict(engine, 999), ZOE_ERR_NOT_FOUND, "");
  CHECK_OK(zoe_tensor_acquire(engine, w, ZOE_TIER_HOST, ZOE_ACCESS_READ_WRITE, &ptr));
  CHECK_FAILS(zoe_tensor_evict(engine, w), ZOE_ERR_BUSY, "");
  CHECK_OK(zoe_tensor_release(engine, w));
  CHECK_OK(zoe_tensor_evict(engine, w));
  CHECK_FAILS(zoe_tensor_release(NULL, w), ZOE_ERR_INVALID_ARGUMENT, "engine is NULL");
  zoe_engine_destroy(engine);
}

/* ---- traces ------------------------------------------------------------------------------ */

static void test_traces(void) {
  zoe_engine* engine = create_engine();
  zoe_tensor_id a;
  zoe_tensor_id b;
  void* ptr = NULL;
  char path[400];
  char* loaded = NULL;
  int iteration;
  FILE* garbage;
  if (engine == NULL) return;
  a = register_tensor(engine, "a", ZOE_TIER_NVME);
  b = register_tensor(engine, "b", ZOE_TIER_NVME);
  for (iteration = 0; iteration < 2; ++iteration) {
    CHECK_OK(zoe_trace_begin(engine, "step"));
    CHECK_OK(zoe_tensor_acquire(engine, a, ZOE_TIER_HOST, ZOE_ACCESS_READ, &ptr));
    CHECK_OK(zoe_tensor_release(engine, a));
    CHECK_OK(zoe_tensor_acquire(engine, b, ZOE_TIER_HOST, ZOE_ACCESS_READ, &ptr));
    CHECK_OK(zoe_tensor_release(engine, b));
    CHECK_OK(zoe_trace_end(engine));
  }
  snprintf(path, sizeof path, "%s/step.trace", root);
  CHECK_OK(zoe_trace_save(engine, "step", path));
  CHECK_OK(zoe_trace_load(engine, path, &loaded));
  CHECK(loaded != NULL && strcmp(loaded, "step") == 0);
  zoe_free(loaded);
  CHECK_OK(zoe_trace_load(engine, path, NULL));

  CHECK_FAILS(zoe_trace_end(engine), ZOE_ERR_FAILED_PRECONDITION, "");
  CHECK_FAILS(zoe_trace_begin(engine, NULL), ZOE_ERR_INVALID_ARGUMENT, "name is NULL");
  CHECK_FAILS(zoe_trace_save(engine, "never", path), ZOE_ERR_NOT_FOUND, "never");
  CHECK_FAILS(zoe_trace_save(engine, "step", NULL), ZOE_ERR_INVALID_ARGUMENT, "path is NULL");
  snprintf(path, sizeof path, "%s/garbage.trace", root);
  garbage = fopen(path, "wb");
  if (garbage != NULL) {
    fputs("not a trace file at all, just some text long enough to hold a header", garbage);
    fclose(garbage);
  }
  loaded = (char*)&loaded;
  CHECK_FAILS(zoe_trace_load(engine, path, &loaded), ZOE_ERR_CORRUPTION, "");
  CHECK(loaded == NULL);
  CHECK_FAILS(zoe_trace_load(engine, NULL, NULL), ZOE_ERR_INVALID_ARGUMENT, "path is NULL");
  snprintf(path, sizeof path, "%s/missing.trace", root);
  CHECK_FAILS(zoe_trace_load(engine, path, NULL), ZOE_ERR_NOT_FOUND, "missing.trace");
  zoe_engine_destroy(engine);
}

/* ---- optimizer groups -------------------------------------------------------------------- */

static float params[kParams];
static float grads[kParams];

static zoe_buffer_view view_of(float* data, uint64_t count) {
  zoe_buffer_view view;
  view.data = data;
  view.dtype = ZOE_DTYPE_FLOAT32;
  view.count = count;
  return view;
}

static int close_to(double got, double want) {
  return fabs(got - want) <= 1e-6 + 1e-5 * fabs(want);
}

/* zoe_optim_group_create's status for a group of the parameters in one view. */
static zoe_status create_group_status(zoe_engine* engine, const char* json) {
  zoe_buffer_view view = view_of(params, kParams);
  zoe_group_id id = ZOE_GROUP_ID_INVALID;
  return zoe_optim_group_create(engine, json, &view, 1, &id);
}

static zoe_group_id create_group(zoe_engine* engine, const char* json) {
  /* The parameters in two views cut at an odd place. */
  zoe_buffer_view views[2];
  zoe_group_id id = ZOE_GROUP_ID_INVALID;
  views[0] = view_of(params, 333);
  views[1] = view_of(params + 333, kParams - 333);
  CHECK_OK(zoe_optim_group_create(engine, json, views, 2, &id));
  return id;
}

/* One AdamW step from zero moments moves each weight by lr * g / (|g| + eps) (bias correction
 * makes m_hat = g and v_hat = g^2), and leaves m = (1 - beta1) g and v = (1 - beta2) g^2. */
static void test_optimizer_group(void) {
  zoe_engine* engine = create_engine();
  zoe_buffer_view grad_view;
  zoe_buffer_view out_view;
  zoe_step_result result = ZOE_STEP_RESULT_INIT;
  zoe_hyper_params hyper = ZOE_HYPER_PARAMS_INIT;
  static float updated[kParams];
  static float state[kParams];
  int64_t steps = -1;
  zoe_group_id group;
  char* json = NULL;
  int i;
  int ok = 1;
  if (engine == NULL) return;
  for (i = 0; i < kParams; ++i) {
    params[i] = 0.5f + 0.001f * (float)i;
    grads[i] = (i % 2 == 0 ? 1.0f : -1.0f) * (0.01f + 0.0001f * (float)i);
  }
  group = create_group(engine, "{\"name\": \"g\", \"type\": \"AdamW\", \"lr\": 0.01}");
  hyper.lr = 0.01;
  hyper.beta1 = 0.9;
  hyper.beta2 = 0.999;
  hyper.eps = 1e-8;
  hyper.weight_decay = 0.0;
  grad_view = view_of(grads, kParams);
  out_view = view_of(updated, kParams);
  CHECK_OK(zoe_optim_step(engine, group, &hyper, &grad_view, 1, &out_view, 1, 1.0, &result));
  CHECK(result.skipped == 0 && result.steps_taken == 1);
  CHECK(result.bytes_read > 0 && result.bytes_written > 0);
  for (i = 0; i < kParams; ++i) {
    const double g = grads[i];
    ok &= close_to(updated[i], params[i] - 0.01 * g / (fabs(g) + 1e-8));
  }
  CHECK(ok);
  CHECK_OK(zoe_optim_state_read(engine, group, ZOE_STATE_MASTER, 0, kParams, state));
  CHECK(memcmp(state, updated, sizeof state) == 0);
  CHECK_OK(zoe_optim_state_read(engine, group, ZOE_STATE_EXP_AVG, 0, kParams, state));
  for (ok = 1, i = 0; i < kParams; ++i) ok &= close_to(state[i], 0.1 * grads[i]);
  CHECK(ok);
  CHECK_OK(zoe_optim_state_read(engine, group, ZOE_STATE_EXP_AVG_SQ, 10, 5, state));
  for (ok = 1, i = 0; i < 5; ++i) ok &= close_to(state[i], 0.001 * grads[10 + i] * grads[10 + i]);
  CHECK(ok);

  /* A NaN gradient skips the step: nothing changes and the count stays. */
  grads[7] = NAN;
  CHECK_OK(zoe_optim_step(engine, group, NULL, &grad_view, 1, NULL, 0, 1.0, &result));
  CHECK(result.skipped == 1 && result.steps_taken == 1);
  grads[7] = 0.01f;
  CHECK_OK(zoe_optim_group_steps(engine, group, &steps));
  CHECK(steps == 1);

  /* State writes land where reads find them; the step count can be set. */
  for (i = 0; i < 4; ++i) state[i] = 0.25f * (float)i;
  CHECK_OK(zoe_optim_state_write(engine, group, ZOE_STATE_EXP_AVG, 100, 4, state));
  memset(state, 0, sizeof state);
  CHECK_OK(zoe_optim_state_read(engine, group, ZOE_STATE_EXP_AVG, 100, 4, state));
  CHECK(state[0] == 0.0f && state[1] == 0.25f && state[2] == 0.5f && state[3] == 0.75f);
  CHECK_OK(zoe_optim_group_set_steps(engine, group, 41));
  CHECK_OK(zoe_optim_group_steps(engine, group, &steps));
  CHECK(steps == 41);

  /* Gradients handed over ahead of the step, in two pieces (a first hand-over of the second
   * piece discarded: its range is free again, and the step counts nothing of it). */
  {
    zoe_buffer_view first = view_of(grads, 500);
    zoe_buffer_view second = view_of(grads + 500, kParams - 500);
    double sum_squares = -1.0;
    double expected;
    CHECK_OK(zoe_optim_accumulate_grad(engine, group, 500, &second));
    CHECK_OK(zoe_optim_discard_grads(engine, group));
    CHECK_FAILS(zoe_optim_step(engine, group, NULL, NULL, 0, NULL, 0, 1.0, NULL),
                ZOE_ERR_FAILED_PRECONDITION, "");
    CHECK_OK(zoe_optim_group_steps(engine, group, &steps));
    CHECK(steps == 41);
    CHECK_FAILS(zoe_optim_discard_grads(NULL, group), ZOE_ERR_INVALID_ARGUMENT, "engine is NULL");
    CHECK_FAILS(zoe_optim_discard_grads(engine, 7), ZOE_ERR_NOT_FOUND, "");
    CHECK_OK(zoe_optim_accumulate_grad(engine, group, 500, &second));
    /* The sum of squares is known once the gradients cover the group. */
    CHECK_FAILS(zoe_optim_grad_sum_squares(engine, group, &sum_squares),
                ZOE_ERR_FAILED_PRECONDITION, "");
    CHECK(sum_squares == 0.0);
    CHECK_OK(zoe_optim_accumulate_grad(engine, group, 0, &first));
    CHECK_OK(zoe_optim_grad_sum_squares(engine, group, &sum_squares));
    for (expected = 0.0, i = 0; i < kParams; ++i) expected += (double)grads[i] * grads[i];
    CHECK(fabs(sum_squares - expected) <= 1e-6 * expected);
    CHECK_FAILS(zoe_optim_grad_sum_squares(engine, group, NULL), ZOE_ERR_INVALID_ARGUMENT, "out");
    CHECK_FAILS(zoe_optim_grad_sum_squares(engine, 7, &sum_squares), ZOE_ERR_NOT_FOUND, "");
    CHECK_OK(zoe_optim_step(engine, group, NULL, NULL, 0, NULL, 0, 1.0, &result));
    CHECK(result.skipped == 0 && result.steps_taken == 42);
  }

  CHECK_OK(zoe_engine_stats_json(engine, &json));
  CHECK(json != NULL && strstr(json, "\"name\":\"g\"") != NULL);
  CHECK(json != NULL && strstr(json, "\"steps_taken\":42") != NULL);
  CHECK(json != NULL && strstr(json, "\"steps_skipped\":1") != NULL);
  zoe_free(json);
  zoe_engine_destroy(engine);
}

/* A speculative group (updates as gradients arrive) and a plain one end bit-identical over a
 * committed step, a skipped one (NaN) and a clipped one; the counts say which way each went. */
static void test_speculation(void) {
  zoe_engine* engine = create_engine();
  static float spec_out[kParams];
  static float plain_out[kParams];
  static float spec_state[kParams];
  static float plain_state[kParams];
  zoe_buffer_view grad_view = view_of(grads, kParams);
  zoe_buffer_view spec_view = view_of(spec_out, kParams);
  zoe_buffer_view plain_view = view_of(plain_out, kParams);
  zoe_buffer_view low = view_of(grads, kSubGroup);
  zoe_buffer_view high = view_of(grads + kSubGroup, kParams - kSubGroup);
  zoe_speculation_stats stats = ZOE_SPECULATION_STATS_INIT;
  zoe_step_result result = ZOE_STEP_RESULT_INIT;
  zoe_group_id spec;
  zoe_group_id plain;
  int step;
  int i;
  if (engine == NULL) return;
  for (i = 0; i < kParams; ++i) params[i] = 0.5f + 0.001f * (float)i;
  spec = create_group(engine, "{\"name\": \"s\", \"speculative\": true, \"max_grad_norm\": 1.0}");
  plain = create_group(engine, "{\"name\": \"p\", \"max_grad_norm\": 1.0}");
  CHECK_FAILS(zoe_optim_speculate(engine, plain, NULL, NULL, 0, 1.0), ZOE_ERR_FAILED_PRECONDITION,
              "speculation is off");
  for (step = 0; step < 3; ++step) {
    /* Step 1 has a NaN; step 2's gradients have a norm above max_grad_norm. */
    for (i = 0; i < kParams; ++i)
      grads[i] = (i % 3 == 0 ? 1.0f : -0.5f) * 1e-3f * (float)(step + 1);
    if (step == 1) grads[3] = NAN;
    if (step == 2) grads[5] = 50.0f;
    CHECK_OK(zoe_optim_speculate(engine, spec, NULL, &spec_view, 1, 1.0));
    CHECK_OK(zoe_optim_accumulate_grad(engine, spec, kSubGroup, &high));
    CHECK_OK(zoe_optim_accumulate_grad(engine, spec, 0, &low));
    CHECK_OK(zoe_optim_step(engine, spec, NULL, NULL, 0, NULL, 0, 1.0, &result));
    CHECK(result.skipped == (step == 1));
    CHECK_OK(zoe_optim_step(engine, plain, NULL, &grad_view, 1, &plain_view, 1, 1.0, &result));
    CHECK(memcmp(spec_out, plain_out, sizeof spec_out) == 0);
    CHECK_OK(zoe_optim_state_read(engine, spec, ZOE_STATE_EXP_AVG_SQ, 0, kParams, spec_state));
    CHECK_OK(zoe_optim_state_read(engine, plain, ZOE_STATE_EXP_AVG_SQ, 0, kParams, plain_state));
    CHECK(memcmp(spec_state, plain_state, sizeof spec_state) == 0);
  }
  CHECK_OK(zoe_optim_group_speculation_stats(engine, spec, &stats));
  CHECK(stats.steps == 3);
  CHECK(stats.chunks_speculative ==
        stats.chunks_committed + stats.chunks_discarded + stats.chunks_recomputed);
  CHECK(stats.chunks_committed > 0 && stats.chunks_committed == stats.chunks_discarded &&
        stats.chunks_committed == stats.chunks_recomputed);
  CHECK_FAILS(zoe_optim_group_speculation_stats(engine, spec, NULL), ZOE_ERR_INVALID_ARGUMENT,
              "out");
  zoe_engine_destroy(engine);
}

static void test_optimizer_errors(void) {
  zoe_engine* engine = create_engine();
  zoe_buffer_view views[2];
  zoe_buffer_view bad;
  zoe_hyper_params hyper = ZOE_HYPER_PARAMS_INIT;
  zoe_step_result result = ZOE_STEP_RESULT_INIT;
  zoe_group_id group;
  zoe_group_id id = 0;
  int64_t steps = 5;
  float values[4] = {0};
  if (engine == NULL) return;
  group = create_group(engine, "{\"name\": \"g\"}");
  views[0] = view_of(params, kParams);
  CHECK_FAILS(zoe_optim_group_create(engine, "{\"name\": \"h\", \"lrr\": 0.1}", views, 1, &id),
              ZOE_ERR_INVALID_ARGUMENT, "did you mean 'lr'?");
  CHECK(id == ZOE_GROUP_ID_INVALID);
  CHECK_FAILS(zoe_optim_group_create(engine, "{\"name\": \"h\", \"type\": \"sgd\"}", views, 1, &id),
              ZOE_ERR_INVALID_ARGUMENT, "type = 'sgd'");
  CHECK_FAILS(zoe_optim_group_create(engine, "{\"lr\": 0.1}", views, 1, &id),
              ZOE_ERR_INVALID_ARGUMENT, "name");
  CHECK_FAILS(zoe_optim_group_create(engine, "{\"name\": \"g\"}", views, 1, &id),
              ZOE_ERR_INVALID_ARGUMENT, "already exists");
  CHECK_FAILS(zoe_optim_group_create(engine, NULL, views, 1, &id), ZOE_ERR_INVALID_ARGUMENT,
              "optim_json is NULL");
  CHECK_FAILS(zoe_optim_group_create(engine, "{\"name\": \"h\"}", NULL, 1, &id),
              ZOE_ERR_INVALID_ARGUMENT, "params is NULL");
  CHECK_FAILS(zoe_optim_group_create(engine, "{\"name\": \"h\"}", views, 0, &id),
              ZOE_ERR_INVALID_ARGUMENT, "at least one parameter");
  CHECK_FAILS(zoe_optim_group_create(engine, "{\"name\": \"h\"}", views, 1, NULL),
              ZOE_ERR_INVALID_ARGUMENT, "out is NULL");
  bad = view_of(params, kParams);
  bad.dtype = ZOE_DTYPE_INT8;
  CHECK_FAILS(zoe_optim_group_create(engine, "{\"name\": \"h\"}", &bad, 1, &id),
              ZOE_ERR_INVALID_ARGUMENT, "params[0].dtype = 3 (int8) is not supported");
  /* zoe_dtypes the optimizer kernels do not take, and a number outside the enum. */
  bad.dtype = ZOE_DTYPE_INT32;
  CHECK_FAILS(zoe_optim_group_create(engine, "{\"name\": \"h\"}", &bad, 1, &id),
              ZOE_ERR_INVALID_ARGUMENT,
              "params[0].dtype = 5 (int32) is not supported by optimizer groups; allowed: "
              "ZOE_DTYPE_FLOAT32, ZOE_DTYPE_BFLOAT16, ZOE_DTYPE_FLOAT16");
  bad.dtype = ZOE_DTYPE_FLOAT64;
  CHECK_FAILS(zoe_optim_group_create(engine, "{\"name\": \"h\"}", &bad, 1, &id),
              ZOE_ERR_INVALID_ARGUMENT, "params[0].dtype = 7 (fp64) is not supported");
  bad.dtype = (zoe_dtype)11;
  CHECK_FAILS(zoe_optim_group_create(engine, "{\"name\": \"h\"}", &bad, 1, &id),
              ZOE_ERR_INVALID_ARGUMENT, "params[0].dtype = 11 (not a zoe_dtype) is not supported");
  CHECK(id == ZOE_GROUP_ID_INVALID);

  hyper.lr = 0.01;
  hyper.beta1 = 1.5;
  hyper.beta2 = 0.999;
  hyper.eps = 1e-8;
  hyper.weight_decay = 0.0;
  views[0] = view_of(grads, kParams);
  result.steps_taken = 99;
  CHECK_FAILS(zoe_optim_step(engine, group, &hyper, views, 1, NULL, 0, 1.0, &result),
              ZOE_ERR_INVALID_ARGUMENT, "beta1");
  CHECK(result.steps_taken == 0);
  CHECK_FAILS(zoe_optim_step(engine, 42, NULL, views, 1, NULL, 0, 1.0, NULL), ZOE_ERR_NOT_FOUND,
              "optimizer group 42");
  CHECK_FAILS(zoe_optim_step(engine, group, NULL, views, 1, NULL, 0, 0.0, NULL),
              ZOE_ERR_INVALID_ARGUMENT, "loss_scale");
  views[0] = view_of(grads, kParams - 1);
  CHECK_FAILS(zoe_optim_step(engine, group, NULL, views, 1, NULL, 0, 1.0, NULL),
              ZOE_ERR_INVALID_ARGUMENT, "999 elements");
  /* A view without data (no gradient) must be whole segments; here the group is one. */
  views[0] = view_of(grads, 10);
  views[1] = view_of(NULL, kParams - 10);
  CHECK_FAILS(zoe_optim_step(engine, group, NULL, views, 2, NULL, 0, 1.0, NULL),
              ZOE_ERR_INVALID_ARGUMENT,
              "gradient view 1 has no gradient (null data) for elements [10, 1000)");
  CHECK_FAILS(zoe_optim_step(engine, group, NULL, NULL, 1, NULL, 0, 1.0, NULL),
              ZOE_ERR_INVALID_ARGUMENT, "grads is NULL");
  bad = view_of(grads, kParams);
  bad.dtype = ZOE_DTYPE_FLOAT64;
  CHECK_FAILS(zoe_optim_step(engine, group, NULL, &bad, 1, NULL, 0, 1.0, NULL),
              ZOE_ERR_INVALID_ARGUMENT,
              "grads[0].dtype = 7 (fp64) is not supported by optimizer groups; allowed: "
              "ZOE_DTYPE_FLOAT32, ZOE_DTYPE_BFLOAT16, ZOE_DTYPE_FLOAT16");
  bad.dtype = ZOE_DTYPE_INT32;
  CHECK_FAILS(zoe_optim_step(engine, group, NULL, views, 1, &bad, 1, 1.0, NULL),
              ZOE_ERR_INVALID_ARGUMENT, "params_out[0].dtype = 5 (int32) is not supported");
  views[0] = view_of(grads, kParams);
  bad = view_of(params, kParams + 1);
  CHECK_FAILS(zoe_optim_step(engine, group, NULL, views, 1, &bad, 1, 1.0, NULL),
              ZOE_ERR_INVALID_ARGUMENT, "params cover 1001 elements");
  CHECK_FAILS(zoe_optim_step(NULL, group, NULL, views, 1, NULL, 0, 1.0, NULL),
              ZOE_ERR_INVALID_ARGUMENT, "engine is NULL");

  CHECK_FAILS(zoe_optim_accumulate_grad(engine, group, 0, NULL), ZOE_ERR_INVALID_ARGUMENT,
              "grad is NULL");
  bad = view_of(grads, 10);
  CHECK_FAILS(zoe_optim_accumulate_grad(engine, group, kParams - 5, &bad), ZOE_ERR_INVALID_ARGUMENT,
              "outside");
  CHECK_FAILS(zoe_optim_accumulate_grad(engine, 7, 0, &bad), ZOE_ERR_NOT_FOUND, "");
  bad.dtype = ZOE_DTYPE_INT8;
  CHECK_FAILS(zoe_optim_accumulate_grad(engine, group, 0, &bad), ZOE_ERR_INVALID_ARGUMENT,
              "grad[0].dtype = 3 (int8) is not supported by optimizer groups");

  CHECK_FAILS(zoe_optim_state_read(engine, group, (zoe_state_slot)5, 0, 4, values),
              ZOE_ERR_INVALID_ARGUMENT, "slot = 5");
  CHECK_FAILS(zoe_optim_state_read(engine, group, ZOE_STATE_MASTER, kParams - 2, 4, values),
              ZOE_ERR_INVALID_ARGUMENT, "outside");
  CHECK_FAILS(zoe_optim_state_read(engine, group, ZOE_STATE_MASTER, 0, 4, NULL),
              ZOE_ERR_INVALID_ARGUMENT, "out is NULL");
  CHECK_FAILS(zoe_optim_state_read(engine, 9, ZOE_STATE_MASTER, 0, 4, values), ZOE_ERR_NOT_FOUND,
              "");
  CHECK_FAILS(zoe_optim_state_write(engine, group, ZOE_STATE_MASTER, 0, 4, NULL),
              ZOE_ERR_INVALID_ARGUMENT, "values is NULL");
  CHECK_FAILS(zoe_optim_state_write(engine, group, ZOE_STATE_EXP_AVG, UINT64_MAX, 4, values),
              ZOE_ERR_INVALID_ARGUMENT, "outside");
  /* A range ending past 2^64 - 1 is printed without wrapping. */
  CHECK_FAILS(zoe_optim_state_read(engine, group, ZOE_STATE_MASTER, UINT64_MAX, 2, values),
              ZOE_ERR_INVALID_ARGUMENT,
              "elements [18446744073709551615, 18446744073709551615 + 2) are outside");
  CHECK_FAILS(zoe_optim_group_steps(engine, 9, &steps), ZOE_ERR_NOT_FOUND, "");
  CHECK(steps == 0);
  CHECK_FAILS(zoe_optim_group_steps(engine, group, NULL), ZOE_ERR_INVALID_ARGUMENT, "out is NULL");
  CHECK_FAILS(zoe_optim_group_set_steps(engine, group, -1), ZOE_ERR_INVALID_ARGUMENT,
              "allowed: [0, 9223372036854775806]");
  /* The step after INT64_MAX would overflow; the one after INT64_MAX - 1 does not. */
  CHECK_FAILS(zoe_optim_group_set_steps(engine, group, INT64_MAX), ZOE_ERR_INVALID_ARGUMENT,
              "steps = 9223372036854775807 is out of range; allowed: [0, 9223372036854775806]");
  CHECK_FAILS(zoe_optim_group_set_steps(engine, 9, 1), ZOE_ERR_NOT_FOUND, "");
  zoe_engine_destroy(engine);
}

/* Memory of the device tier handed over where a host buffer is taken (here the host stand-in's,
 * which the host could read; a GPU's would crash it) is refused, naming the argument. */
static void test_device_memory_is_not_a_host_buffer(void) {
  zoe_engine* engine = create_engine();
  zoe_group_id group;
  zoe_tensor_id tensor;
  zoe_buffer_view view;
  void* device = NULL;
  if (engine == NULL) return;
  group = create_group(engine, "{\"name\": \"g\"}");
  tensor = register_tensor(engine, "on-device", ZOE_TIER_HOST);
  CHECK_OK(zoe_tensor_acquire(engine, tensor, ZOE_TIER_DEVICE, ZOE_ACCESS_READ_WRITE, &device));
  CHECK_FAILS(zoe_optim_state_write(engine, group, ZOE_STATE_MASTER, 0, 4, (const float*)device),
              ZOE_ERR_INVALID_ARGUMENT, "values (4 elements of 4 bytes at 0x");
  CHECK_FAILS(zoe_optim_state_read(engine, group, ZOE_STATE_MASTER, 0, 4, (float*)device),
              ZOE_ERR_INVALID_ARGUMENT, "is in the device tier's memory (device 'host stand-in");
  CHECK_FAILS(zoe_optim_group_segment_steps(engine, group, (int64_t*)device, 1),
              ZOE_ERR_INVALID_ARGUMENT, "out (1 elements of 8 bytes");
  CHECK_FAILS(zoe_optim_group_set_segment_steps(engine, group, (const int64_t*)device, 1),
              ZOE_ERR_INVALID_ARGUMENT, "steps (1 elements");
  /* A count past the address space still overlaps the device memory above the pointer. */
  CHECK_FAILS(zoe_optim_state_write(engine, group, ZOE_STATE_MASTER, 0, UINT64_MAX / 2,
                                    (const float*)device - 8),
              ZOE_ERR_INVALID_ARGUMENT, "is in the device tier's memory");
  view = view_of((float*)device, kParams);
  CHECK_FAILS(zoe_optim_accumulate_grad(engine, group, 0, &view), ZOE_ERR_INVALID_ARGUMENT,
              "grad[0].data");
  view = view_of(grads, kParams);
  {
    zoe_buffer_view out = view_of((float*)device, kParams);
    CHECK_FAILS(zoe_optim_step(engine, group, NULL, &view, 1, &out, 1, 1.0, NULL),
                ZOE_ERR_INVALID_ARGUMENT, "params_out[0].data");
  }
  CHECK_OK(zoe_tensor_release(engine, tensor));
  /* The same calls with host memory work (nothing was changed by the refusals). */
  CHECK_OK(zoe_optim_state_write(engine, group, ZOE_STATE_MASTER, 0, 4, params));
  zoe_engine_destroy(engine);
}

/* Segments: a grads view with data NULL skips its segments (state and step count untouched);
 * the others step with their own step counts, which can be read and set. */
static void test_optimizer_segments(void) {
  zoe_engine* engine = create_engine();
  zoe_buffer_view grad_views[2];
  zoe_buffer_view bad[3];
  zoe_step_result result = ZOE_STEP_RESULT_INIT;
  static float before[kParams];
  static float after[kParams];
  int64_t counts[3] = {0, 0, 0};
  const int64_t loaded[3] = {4, 0, 9};
  const int64_t negative[3] = {1, -1, 1};
  zoe_group_id group;
  if (engine == NULL) return;
  group = create_group(engine, "{\"name\": \"s\", \"segments\": [400, 0, 600]}");
  grad_views[0] = view_of(grads, 400);
  grad_views[1] = view_of(NULL, kParams - 400);
  CHECK_OK(zoe_optim_state_read(engine, group, ZOE_STATE_MASTER, 0, kParams, before));
  CHECK_OK(zoe_optim_step(engine, group, NULL, grad_views, 2, NULL, 0, 1.0, &result));
  CHECK(result.skipped == 0 && result.steps_taken == 1);
  CHECK_OK(zoe_optim_state_read(engine, group, ZOE_STATE_MASTER, 0, kParams, after));
  CHECK(memcmp(after, before, 400 * sizeof(float)) != 0);
  CHECK(memcmp(after + 400, before + 400, (kParams - 400) * sizeof(float)) == 0);
  CHECK_OK(zoe_optim_group_segment_steps(engine, group, counts, 3));
  CHECK(counts[0] == 1 && counts[1] == 0 && counts[2] == 0);
  CHECK_OK(zoe_optim_group_set_segment_steps(engine, group, loaded, 3));
  CHECK_OK(zoe_optim_group_segment_steps(engine, group, counts, 3));
  CHECK(counts[0] == 4 && counts[1] == 0 && counts[2] == 9);

  /* An absent range cutting a segment, counts of the wrong length or negative are refused. */
  bad[0] = view_of(grads, 200);
  bad[1] = view_of(NULL, 300);
  bad[2] = view_of(grads + 500, kParams - 500);
  CHECK_FAILS(zoe_optim_step(engine, group, NULL, bad, 3, NULL, 0, 1.0, NULL),
              ZOE_ERR_INVALID_ARGUMENT, "whole segments");
  CHECK_FAILS(zoe_optim_group_segment_steps(engine, group, counts, 2), ZOE_ERR_INVALID_ARGUMENT,
              "optimizer group 's' has 3 segments; n = 2");
  CHECK_FAILS(zoe_optim_group_segment_steps(engine, group, NULL, 3), ZOE_ERR_INVALID_ARGUMENT,
              "out is NULL");
  CHECK_FAILS(zoe_optim_group_set_segment_steps(engine, group, negative, 3),
              ZOE_ERR_INVALID_ARGUMENT, "segment 1 step count = -1");
  CHECK_FAILS(zoe_optim_group_set_segment_steps(engine, 9, loaded, 3), ZOE_ERR_NOT_FOUND, "");
  CHECK_FAILS(zoe_optim_group_set_segment_steps(engine, group, NULL, 3), ZOE_ERR_INVALID_ARGUMENT,
              "steps is NULL");
  CHECK_FAILS(zoe_optim_group_set_segment_steps(engine, group, loaded, 2), ZOE_ERR_INVALID_ARGUMENT,
              "2 segment step counts given; the group has 3");
  CHECK_OK(zoe_optim_group_segment_steps(engine, group, counts, 3));
  CHECK(counts[0] == 4 && counts[1] == 0 && counts[2] == 9);
  CHECK_FAILS(create_group_status(engine, "{\"name\": \"t\", \"segments\": [1, -2]}"),
              ZOE_ERR_INVALID_ARGUMENT, "segments[1] = -2");
  CHECK_FAILS(create_group_status(engine, "{\"name\": \"v\", \"segments\": 5}"),
              ZOE_ERR_INVALID_ARGUMENT, "expected a list of segment lengths");
  CHECK_FAILS(create_group_status(engine, "{\"name\": \"u\", \"segments\": [1, 2]}"),
              ZOE_ERR_INVALID_ARGUMENT, "add up to count");
  zoe_engine_destroy(engine);
}

/* ---- checkpoints ------------------------------------------------------------------------- */

static int file_contains(const char* path, const char* needle) {
  static char text[65536];
  size_t n;
  FILE* file = fopen(path, "rb");
  if (file == NULL) return 0;
  n = fread(text, 1, sizeof text - 1, file);
  fclose(file);
  text[n] = '\0';
  return strstr(text, needle) != NULL;
}

static void test_checkpoints(void) {
  zoe_engine* engine = create_engine();
  zoe_engine* other = NULL;
  zoe_buffer_view grad_view = view_of(grads, kParams);
  static float saved[kParams];
  static float now[kParams];
  char dir[400];
  char manifest[500];
  char latest[64] = {0};
  char path[450];
  FILE* file;
  int64_t steps = 0;
  zoe_group_id group;
  if (engine == NULL) return;
  group = create_group(engine, "{\"name\": \"g\", \"moment_dtype\": \"bf16\"}");
  CHECK_OK(zoe_optim_step(engine, group, NULL, &grad_view, 1, NULL, 0, 1.0, NULL));
  snprintf(dir, sizeof dir, "%s/ckpt", root);
  CHECK_OK(zoe_checkpoint_save(engine, dir));
  CHECK_OK(zoe_optim_state_read(engine, group, ZOE_STATE_MASTER, 0, kParams, saved));
  CHECK_OK(zoe_optim_step(engine, group, NULL, &grad_view, 1, NULL, 0, 1.0, NULL));
  CHECK_OK(zoe_optim_state_read(engine, group, ZOE_STATE_MASTER, 0, kParams, now));
  CHECK(memcmp(now, saved, sizeof now) != 0);
  CHECK_OK(zoe_checkpoint_load(engine, dir));
  CHECK_OK(zoe_optim_state_read(engine, group, ZOE_STATE_MASTER, 0, kParams, now));
  CHECK(memcmp(now, saved, sizeof now) == 0);
  CHECK_OK(zoe_optim_group_steps(engine, group, &steps));
  CHECK(steps == 1);

  /* The manifest names the library's version and the group. */
  snprintf(path, sizeof path, "%s/LATEST", dir);
  file = fopen(path, "rb");
  CHECK(file != NULL);
  if (file != NULL) {
    CHECK(fgets(latest, sizeof latest, file) != NULL);
    fclose(file);
    latest[strcspn(latest, "\n")] = '\0';
    snprintf(manifest, sizeof manifest, "%s/%s/manifest.json", dir, latest);
    CHECK(file_contains(manifest, zoe_version()));
    CHECK(file_contains(manifest, "\"g\""));
  }

  /* Another engine with another group refuses the checkpoint and keeps its state. */
  CHECK_OK(zoe_engine_create(config, &other));
  if (other != NULL) {
    zoe_group_id h = create_group(other, "{\"name\": \"h\"}");
    CHECK_FAILS(zoe_checkpoint_load(other, dir), ZOE_ERR_FAILED_PRECONDITION, "\"h\"");
    CHECK_OK(zoe_optim_state_read(other, h, ZOE_STATE_MASTER, 0, kParams, now));
    CHECK(memcmp(now, params, sizeof now) == 0);
    zoe_engine_destroy(other);
  }
  snprintf(path, sizeof path, "%s/none", root);
  CHECK_FAILS(zoe_checkpoint_load(engine, path), ZOE_ERR_NOT_FOUND, path);
  CHECK_FAILS(zoe_checkpoint_save(engine, NULL), ZOE_ERR_INVALID_ARGUMENT, "dir is NULL");
  CHECK_FAILS(zoe_checkpoint_load(engine, NULL), ZOE_ERR_INVALID_ARGUMENT, "dir is NULL");
  CHECK_FAILS(zoe_checkpoint_save(NULL, dir), ZOE_ERR_INVALID_ARGUMENT, "engine is NULL");
  zoe_engine_destroy(engine);
}

int main(void) {
  if (!make_dirs()) {
    fprintf(stderr, "cannot create a temporary directory\n");
    return 1;
  }
  make_config();
  test_create_and_json();
  test_create_errors();
  test_config_check();
  test_config_normalize();
  test_default_config();
  test_tensor_round_trip();
  test_tensor_errors();
  test_traces();
  test_optimizer_group();
  test_optimizer_errors();
  test_device_memory_is_not_a_host_buffer();
  test_speculation();
  test_optimizer_segments();
  test_checkpoints();
  nftw(root, remove_entry, 16, FTW_DEPTH | FTW_PHYS);
  return finish_checks();
}
