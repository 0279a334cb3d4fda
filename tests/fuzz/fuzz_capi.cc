// Fuzzes the C API: the input is a sequence of calls on a small engine (tensors, traces,
// optimizer groups, steps, checkpoints, statistics) with valid and invalid handles, ids, sizes and
// enum values, and every call is checked against the promises of zoe.h: a numbered status,
// zoe_last_error() empty on success and not on failure, out-parameters reset on failure, and
// tensor bytes that read back as last written.
//
// Input: one byte choosing the configuration, then calls, each an opcode byte followed by its
// argument bytes (see the Call* functions; a missing byte reads as 0).
#include <xxhash.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include "fmt/format.h"
#include "tests/fuzz/fuzz_check.h"
#include "tests/fuzz/fuzz_scratch.h"
#include "zoe.h"

namespace zoe::fuzz {
namespace {

namespace fs = std::filesystem;

constexpr uint64_t kChunkBytes = 16 * 1024;
constexpr uint64_t kMaxTensorBytes = 2 * kChunkBytes;
constexpr size_t kMaxCalls = 64;
constexpr size_t kMaxHeldTensors = 2;  // pinned runs that fit every budget: no acquire waits
constexpr uint64_t kMaxViewCount = 1200;
constexpr int kLastStatus = ZOE_ERR_INTERNAL;

// Reads the input front to back; past its end every read is 0.
class ByteReader {
 public:
  ByteReader(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  bool empty() const { return pos_ >= size_; }
  uint8_t U8() { return pos_ < size_ ? data_[pos_++] : 0; }
  uint16_t U16() { return static_cast<uint16_t>(U8() | (U8() << 8)); }
  std::string Bytes(size_t n) {
    n = std::min(n, size_ - std::min(pos_, size_));
    std::string out(reinterpret_cast<const char*>(data_ + pos_), n);
    pos_ += n;
    return out;
  }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
};

// The directory of one input's files, emptied first so that every input runs alone.
std::string ResetScratch() {
  const std::string root = ProcessScratchDirectory("capi") + "/run";
  fs::remove_all(root);
  fs::create_directories(root + "/nvme");
  return root;
}

// ZOE_FUZZ_VERBOSE=1 prints every call and its outcome, to see what an input does.
bool Verbose() {
  static const bool verbose = std::getenv("ZOE_FUZZ_VERBOSE") != nullptr;
  return verbose;
}

// The statuses zoe.h defines, and zoe_last_error() agreeing with the outcome.
zoe_status Checked(zoe_status status, std::string_view call) {
  const int code = static_cast<int>(status);
  if (Verbose()) {
    std::fprintf(stderr, "%.*s: %s %s\n", static_cast<int>(call.size()), call.data(),
                 zoe_status_string(status), zoe_last_error());
  }
  FUZZ_CHECK(code >= ZOE_OK && code <= kLastStatus, fmt::format("{} returned {}", call, code));
  const char* message = zoe_last_error();
  FUZZ_CHECK(message != nullptr, std::string(call));
  if (status == ZOE_OK) {
    FUZZ_CHECK(message[0] == '\0', fmt::format("{} succeeded with error '{}'", call, message));
  } else {
    FUZZ_CHECK(message[0] != '\0', fmt::format("{} failed ({}) with an empty zoe_last_error()",
                                               call, zoe_status_string(status)));
    FUZZ_CHECK(status != ZOE_ERR_INTERNAL, fmt::format("{}: {}", call, message));
  }
  return status;
}

zoe_dtype ViewDType(uint8_t byte) {
  static constexpr std::array<zoe_dtype, 4> kDTypes = {ZOE_DTYPE_FLOAT32, ZOE_DTYPE_BFLOAT16,
                                                       ZOE_DTYPE_FLOAT16, ZOE_DTYPE_INT32};
  return kDTypes[byte % kDTypes.size()];
}

size_t ElementBytes(zoe_dtype dtype) {
  return dtype == ZOE_DTYPE_FLOAT32 || dtype == ZOE_DTYPE_INT32 ? 4 : 2;
}

// Caller-owned buffers for views: each holds exactly what its view declares.
class Buffers {
 public:
  zoe_buffer_view Make(zoe_dtype dtype, uint64_t count, uint8_t pattern) {
    storage_.emplace_back(count * ElementBytes(dtype));
    std::vector<uint8_t>& bytes = storage_.back();
    if (dtype == ZOE_DTYPE_FLOAT32) {
      for (uint64_t i = 0; i < count; ++i) {
        const float v = Value(pattern, i);
        std::memcpy(bytes.data() + 4 * i, &v, 4);
      }
    } else {
      for (uint64_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<uint8_t>(i * 7 + pattern);
    }
    return zoe_buffer_view{bytes.data(), dtype, count};
  }

 private:
  static float Value(uint8_t pattern, uint64_t i) {
    switch (pattern % 6) {
      case 0:
        return static_cast<float>(static_cast<int>(i % 7) - 3) * 0.01f;
      case 1:
        return i == 3 ? std::numeric_limits<float>::infinity() : 0.5f;
      case 2:
        return i == 5 ? std::numeric_limits<float>::quiet_NaN() : -0.25f;
      case 3:
        return 0.0f;
      case 4:
        return 1e30f;
      default:
        return std::numeric_limits<float>::denorm_min();
    }
  }

  std::vector<std::vector<uint8_t>> storage_;
};

struct TensorModel {
  zoe_tensor_id id;
  std::string name;
  uint64_t bytes;
  uint8_t fill = 0;   // every byte's value when `known`
  bool known = true;  // false after a write the model cannot follow
  int held = 0;       // outstanding acquires
};

struct GroupModel {
  zoe_group_id id;
  uint64_t elements;
};

struct Held {
  zoe_tensor_id id;
};

class Session {
 public:
  Session(zoe_engine* engine, std::string root) : engine_(engine), root_(std::move(root)) {}
  ~Session() {
    for (const Held& held : held_) (void)zoe_tensor_release(engine_, held.id);
    zoe_engine_destroy(engine_);
  }

  void Run(ByteReader& in) {
    for (size_t i = 0; i < kMaxCalls && !in.empty(); ++i) Call(in);
  }

 private:
  void Call(ByteReader& in);
  void CallRegister(ByteReader& in);
  void CallFind(ByteReader& in);
  void CallAcquire(ByteReader& in);
  void CallRelease(ByteReader& in);
  void CallPrefetchOrEvict(ByteReader& in, bool evict);
  void CallTraceBeginEnd(ByteReader& in, bool begin);
  void CallTraceSave(ByteReader& in);
  void CallTraceLoad(ByteReader& in);
  void CallGroupCreate(ByteReader& in);
  void CallStep(ByteReader& in);
  void CallAccumulate(ByteReader& in);
  void CallState(ByteReader& in, bool write);
  void CallSteps(ByteReader& in);
  void CallCheckpoint(ByteReader& in, bool save);
  std::vector<float> AllState();
  void CallEngineQueries(ByteReader& in);
  void CallNullArguments(ByteReader& in);

  zoe_tensor_id PickTensor(uint8_t byte) const;
  zoe_group_id PickGroup(uint8_t byte) const;
  TensorModel* FindTensor(zoe_tensor_id id);
  const GroupModel* FindGroup(zoe_group_id id) const;
  std::string Path(std::string_view name) const { return root_ + "/" + std::string(name); }
  void CheckContents(const TensorModel& tensor, const uint8_t* bytes, std::string_view how);

  zoe_engine* engine_;
  std::string root_;
  std::vector<TensorModel> tensors_;
  std::vector<GroupModel> groups_;
  std::vector<Held> held_;
  Buffers accumulated_;  // gradients handed to zoe_optim_accumulate_grad
  uint8_t next_fill_ = 1;
};

zoe_tensor_id Session::PickTensor(uint8_t byte) const {
  if (byte < 200 && !tensors_.empty()) return tensors_[byte % tensors_.size()].id;
  const std::array<zoe_tensor_id, 3> invalid = {ZOE_TENSOR_ID_INVALID,
                                                static_cast<zoe_tensor_id>(tensors_.size()), 4097};
  return invalid[byte % invalid.size()];
}

zoe_group_id Session::PickGroup(uint8_t byte) const {
  if (byte < 200 && !groups_.empty()) return groups_[byte % groups_.size()].id;
  const std::array<zoe_group_id, 3> invalid = {ZOE_GROUP_ID_INVALID,
                                               static_cast<zoe_group_id>(groups_.size()), 77};
  return invalid[byte % invalid.size()];
}

TensorModel* Session::FindTensor(zoe_tensor_id id) {
  for (TensorModel& t : tensors_) {
    if (t.id == id) return &t;
  }
  return nullptr;
}

const GroupModel* Session::FindGroup(zoe_group_id id) const {
  for (const GroupModel& g : groups_) {
    if (g.id == id) return &g;
  }
  return nullptr;
}

const char* TensorName(uint8_t byte) {
  static constexpr std::array<const char*, 9> kNames = {"w0", "w1",  "w2", "w3",   "b0",
                                                        "b1", "emb", "",   nullptr};
  return kNames[byte % kNames.size()];
}

void Session::CallRegister(ByteReader& in) {
  const char* name = TensorName(in.U8());
  zoe_tensor_desc desc = ZOE_TENSOR_DESC_INIT;
  desc.name = name;
  desc.bytes = in.U16() % (kMaxTensorBytes + 1);
  desc.dtype = static_cast<zoe_dtype>(in.U8() % 12);  // 11 is outside the enum
  desc.home = static_cast<zoe_tier>(in.U8() % 4);     // 3 is outside the enum
  static constexpr std::array<const char*, 3> kGroups = {nullptr, "", "layers"};
  desc.group = kGroups[in.U8() % kGroups.size()];
  zoe_tensor_id id = 12345;
  if (Checked(zoe_tensor_register(engine_, &desc, &id), "zoe_tensor_register") != ZOE_OK) {
    FUZZ_CHECK(id == ZOE_TENSOR_ID_INVALID, "a failed register left an id");
    return;
  }
  FUZZ_CHECK(FindTensor(id) == nullptr, fmt::format("tensor id {} given twice", id));
  tensors_.push_back(TensorModel{id, name, desc.bytes});
}

void Session::CallFind(ByteReader& in) {
  const char* name = TensorName(in.U8());
  zoe_tensor_id id = 12345;
  const zoe_status status = Checked(zoe_tensor_find(engine_, name, &id), "zoe_tensor_find");
  const auto known = std::find_if(tensors_.begin(), tensors_.end(), [&](const TensorModel& t) {
    return name != nullptr && t.name == name;
  });
  if (status != ZOE_OK) {
    FUZZ_CHECK(id == ZOE_TENSOR_ID_INVALID, "a failed find left an id");
    FUZZ_CHECK(known == tensors_.end(), fmt::format("registered tensor '{}' not found", name));
    return;
  }
  FUZZ_CHECK(known != tensors_.end() && known->id == id, fmt::format("found '{}' as {}", name, id));
}

// A tensor acquired alone reads as it was last written (zeros before any write).
void Session::CheckContents(const TensorModel& tensor, const uint8_t* bytes, std::string_view how) {
  if (!tensor.known || tensor.held > 1) return;
  for (uint64_t i = 0; i < tensor.bytes; ++i) {
    FUZZ_CHECK(bytes[i] == tensor.fill,
               fmt::format("tensor '{}' ({}): byte {} of {} reads {} after {}, expected {}",
                           tensor.name, how, i, tensor.bytes, bytes[i], how, tensor.fill));
  }
}

void Session::CallAcquire(ByteReader& in) {
  const zoe_tensor_id id = PickTensor(in.U8());
  const zoe_tier tier = static_cast<zoe_tier>(in.U8() % 4);
  const zoe_access access = static_cast<zoe_access>(in.U8() % 4);
  TensorModel* tensor = FindTensor(id);
  const bool already_held =
      std::any_of(held_.begin(), held_.end(), [&](const Held& h) { return h.id == id; });
  if (tensor != nullptr && !already_held && held_.size() >= kMaxHeldTensors) return;
  void* ptr = reinterpret_cast<void*>(uintptr_t{1});
  if (Checked(zoe_tensor_acquire(engine_, id, tier, access, &ptr), "zoe_tensor_acquire") !=
      ZOE_OK) {
    FUZZ_CHECK(ptr == nullptr, "a failed acquire left a pointer");
    return;
  }
  FUZZ_CHECK(tensor != nullptr, fmt::format("acquired unknown tensor {}", id));
  FUZZ_CHECK(ptr != nullptr || tensor->bytes == 0, "acquire gave NULL");
  held_.push_back(Held{id});
  ++tensor->held;
  auto* bytes = static_cast<uint8_t*>(ptr);
  if (access != ZOE_ACCESS_WRITE) CheckContents(*tensor, bytes, tier == 0 ? "device" : "host");
  if (access == ZOE_ACCESS_READ || tensor->bytes == 0) return;
  const uint8_t fill = next_fill_++;
  std::memset(bytes, fill, tensor->bytes);
  tensor->fill = fill;
  // With another acquire of the tensor outstanding, which copy holds the bytes is not followed.
  tensor->known = tensor->held == 1;
}

void Session::CallRelease(ByteReader& in) {
  const zoe_tensor_id id = PickTensor(in.U8());
  const zoe_status status = Checked(zoe_tensor_release(engine_, id), "zoe_tensor_release");
  const auto held =
      std::find_if(held_.begin(), held_.end(), [&](const Held& h) { return h.id == id; });
  if (status != ZOE_OK) {
    FUZZ_CHECK(held == held_.end(), fmt::format("release of held tensor {} failed", id));
    return;
  }
  FUZZ_CHECK(held != held_.end(), fmt::format("released tensor {} that was not held", id));
  held_.erase(held);
  --FindTensor(id)->held;
}

void Session::CallPrefetchOrEvict(ByteReader& in, bool evict) {
  const zoe_tensor_id id = PickTensor(in.U8());
  const zoe_tier tier = static_cast<zoe_tier>(in.U8() % 4);
  if (evict) {
    (void)Checked(zoe_tensor_evict(engine_, id), "zoe_tensor_evict");
  } else {
    (void)Checked(zoe_tensor_prefetch(engine_, id, tier), "zoe_tensor_prefetch");
  }
}

const char* TraceName(uint8_t byte) {
  static constexpr std::array<const char*, 4> kNames = {"forward", "backward", "", nullptr};
  return kNames[byte % kNames.size()];
}

void Session::CallTraceBeginEnd(ByteReader& in, bool begin) {
  if (begin) {
    (void)Checked(zoe_trace_begin(engine_, TraceName(in.U8())), "zoe_trace_begin");
  } else {
    (void)Checked(zoe_trace_end(engine_), "zoe_trace_end");
  }
}

std::string TraceFile(uint8_t byte) {
  static constexpr std::array<const char*, 3> kFiles = {"a.trace", "b.trace", "no-dir/c.trace"};
  return kFiles[byte % kFiles.size()];
}

void Session::CallTraceSave(ByteReader& in) {
  const char* name = TraceName(in.U8());
  const std::string path = Path(TraceFile(in.U8()));
  (void)Checked(zoe_trace_save(engine_, name, path.c_str()), "zoe_trace_save");
}

std::string ReadFile(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(file), std::istreambuf_iterator<char>());
}

// Loads a saved trace, or one with input bytes written over it and its checksum made to match,
// so the loader and the replay meet events the engine never recorded.
void Session::CallTraceLoad(ByteReader& in) {
  std::string path = Path(TraceFile(in.U8()));
  const uint8_t patch = in.U8();
  if (patch & 1) {
    std::string bytes = ReadFile(path);
    const size_t offset = in.U16();
    const std::string replacement = in.Bytes(in.U8() % 32);
    if (bytes.size() >= 8 && offset < bytes.size() - 8) {
      const size_t n = std::min(replacement.size(), bytes.size() - 8 - offset);
      bytes.replace(offset, n, replacement.substr(0, n));
      const uint64_t sum = XXH3_64bits(bytes.data(), bytes.size() - 8);
      for (size_t i = 0; i < 8; ++i)
        bytes[bytes.size() - 8 + i] = static_cast<char>(sum >> (8 * i));
    }
    path = Path("patched.trace");
    std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
  }
  char* name = reinterpret_cast<char*>(uintptr_t{1});
  char** out_name = (patch & 2) ? nullptr : &name;
  if (Checked(zoe_trace_load(engine_, path.c_str(), out_name), "zoe_trace_load") != ZOE_OK) {
    FUZZ_CHECK(out_name == nullptr || name == nullptr, "a failed trace load left a name");
    return;
  }
  if (out_name != nullptr) {
    FUZZ_CHECK(name != nullptr, "trace load gave no name");
    zoe_free(name);
  }
}

std::string GroupJson(uint8_t name, uint8_t variant) {
  static constexpr std::array<std::string_view, 12> kVariants = {
      "",
      R"(, "type": "Adam", "lr": 0.01, "weight_decay": 0.1)",
      R"(, "type": "Lion", "betas": [0.9, 0.99])",
      R"(, "type": "Adagrad", "lr_decay": 0.01)",
      R"(, "type": "AdamW", "moment_dtype": "bf16", "eps": 1e-6)",
      R"(, "max_grad_norm": 0.5)",
      R"(, "betas": [0.9, 1.5])",
      R"(, "lr": -1)",
      R"(, "type": "SGD")",
      R"(, "lerning_rate": 1)",
      R"(, "moment_dtype": "fp8")",
      R"(, "eps": 0})",
  };
  if (variant % 16 == 15) return "{\"name\": ";  // not JSON
  return fmt::format(R"({{"name": "g{}"{}}})", name % 3, kVariants[variant % kVariants.size()]);
}

void Session::CallGroupCreate(ByteReader& in) {
  const std::string json = GroupJson(in.U8(), in.U8());
  Buffers buffers;
  std::vector<zoe_buffer_view> views(in.U8() % 4);
  uint64_t elements = 0;
  for (zoe_buffer_view& view : views) {
    const uint64_t count = in.U16() % (kMaxViewCount + 1);
    view = buffers.Make(ViewDType(in.U8()), count, in.U8());
    elements += count;
  }
  zoe_group_id id = 12345;
  const zoe_status status =
      Checked(zoe_optim_group_create(engine_, json.c_str(), views.data(), views.size(), &id),
              "zoe_optim_group_create");
  if (status != ZOE_OK) {
    FUZZ_CHECK(id == ZOE_GROUP_ID_INVALID, "a failed group create left an id");
    return;
  }
  FUZZ_CHECK(id == groups_.size(), fmt::format("group id {} after {} groups", id, groups_.size()));
  groups_.push_back(GroupModel{id, elements});
}

// Views covering `elements` (or, on purpose, one element short or over), split in up to two.
std::vector<zoe_buffer_view> CoveringViews(Buffers& buffers, uint64_t elements, uint8_t shape,
                                           uint8_t pattern) {
  const uint64_t total = shape % 5 == 3               ? elements + 1
                         : shape % 5 == 4 && elements ? elements - 1
                                                      : elements;
  const zoe_dtype dtype = (shape & 8) ? ViewDType(shape >> 4) : ZOE_DTYPE_FLOAT32;
  if (shape % 5 == 1 && total > 1) {
    return {buffers.Make(dtype, total / 2, pattern),
            buffers.Make(dtype, total - total / 2, pattern)};
  }
  return {buffers.Make(dtype, total, pattern)};
}

zoe_hyper_params Hyper(uint8_t byte) {
  zoe_hyper_params hyper = ZOE_HYPER_PARAMS_INIT;
  hyper.weight_decay = 0.01;
  switch (byte % 5) {
    case 1:
      hyper.lr = -1.0;
      break;
    case 2:
      hyper.beta2 = 1.0;
      break;
    case 3:
      hyper.eps = std::numeric_limits<double>::quiet_NaN();
      break;
    case 4:
      hyper.lr = 0.5;
      break;
    default:
      break;
  }
  return hyper;
}

void Session::CallStep(ByteReader& in) {
  const zoe_group_id id = PickGroup(in.U8());
  const GroupModel* group = FindGroup(id);
  const uint64_t elements = group != nullptr ? group->elements : in.U8();
  const uint8_t grads_shape = in.U8();
  const uint8_t pattern = in.U8();
  const uint8_t hyper_byte = in.U8();
  const uint8_t params_shape = in.U8();
  static constexpr std::array<double, 6> kLossScales = {1.0,
                                                        65536.0,
                                                        0.0,
                                                        -1.0,
                                                        std::numeric_limits<double>::quiet_NaN(),
                                                        std::numeric_limits<double>::infinity()};
  const double loss_scale = kLossScales[in.U8() % kLossScales.size()];
  Buffers buffers;
  std::vector<zoe_buffer_view> grads;  // empty: the accumulated gradients
  if (grads_shape % 7 != 6) grads = CoveringViews(buffers, elements, grads_shape, pattern);
  std::vector<zoe_buffer_view> params;
  if (params_shape & 1) params = CoveringViews(buffers, elements, params_shape >> 1, 0);
  const zoe_hyper_params hyper = Hyper(hyper_byte);
  zoe_step_result result;
  std::memset(&result, 0xab, sizeof result);
  result.struct_size = sizeof result;
  const zoe_status status =
      Checked(zoe_optim_step(engine_, id, hyper_byte % 2 ? &hyper : nullptr, grads.data(),
                             grads.size(), params.data(), params.size(), loss_scale, &result),
              "zoe_optim_step");
  if (status != ZOE_OK) {
    FUZZ_CHECK(result.steps_taken == 0 && result.skipped == 0, "a failed step left a result");
    return;
  }
  FUZZ_CHECK(group != nullptr, fmt::format("stepped unknown group {}", id));
  FUZZ_CHECK(result.skipped == 0 || result.skipped == 1, "skipped is not 0 or 1");
  int64_t steps = -1;
  (void)Checked(zoe_optim_group_steps(engine_, id, &steps), "zoe_optim_group_steps");
  FUZZ_CHECK(steps == result.steps_taken,
             fmt::format("step reported {} steps, the group has {}", result.steps_taken, steps));
}

void Session::CallAccumulate(ByteReader& in) {
  const zoe_group_id id = PickGroup(in.U8());
  const uint64_t offset = in.U16() % (kMaxViewCount + 100);
  const uint64_t count = in.U16() % (kMaxViewCount + 100);
  const zoe_dtype dtype = ViewDType(in.U8());
  // Borrowed until the step that uses it returns: kept for the whole session.
  const zoe_buffer_view grad = accumulated_.Make(dtype, count, in.U8());
  (void)Checked(zoe_optim_accumulate_grad(engine_, id, offset, &grad), "zoe_optim_accumulate_grad");
  double sum_squares = -1.0;
  if (Checked(zoe_optim_grad_sum_squares(engine_, id, &sum_squares),
              "zoe_optim_grad_sum_squares") != ZOE_OK) {
    FUZZ_CHECK(sum_squares == 0.0, "a failed zoe_optim_grad_sum_squares did not zero *out");
  }
  if (in.U8() % 4 == 0) {  // an iteration abandoned: what was handed over is dropped
    (void)Checked(zoe_optim_discard_grads(engine_, id), "zoe_optim_discard_grads");
  }
}

void Session::CallState(ByteReader& in, bool write) {
  const zoe_group_id id = PickGroup(in.U8());
  const zoe_state_slot slot = static_cast<zoe_state_slot>(in.U8() % 4);  // 3 is outside
  const uint64_t offset = in.U16() % (4 * kMaxViewCount + 100);
  const uint64_t count = in.U16() % (4 * kMaxViewCount + 100);
  std::vector<float> values(count, 0.125f);  // exact in bf16 moments too
  if (write) {
    if (Checked(zoe_optim_state_write(engine_, id, slot, offset, count, values.data()),
                "zoe_optim_state_write") != ZOE_OK) {
      return;
    }
    std::vector<float> read(count, -1.0f);
    (void)Checked(zoe_optim_state_read(engine_, id, slot, offset, count, read.data()),
                  "zoe_optim_state_read");
    FUZZ_CHECK(read == values, fmt::format("state [{}, {}) of group {} slot {} does not read back "
                                           "as written",
                                           offset, offset + count, id, static_cast<int>(slot)));
    return;
  }
  if (Checked(zoe_optim_state_read(engine_, id, slot, offset, count, values.data()),
              "zoe_optim_state_read") != ZOE_OK) {
    return;
  }
  const GroupModel* group = FindGroup(id);
  if (count == 0) return;
  FUZZ_CHECK(group != nullptr && offset + count <= group->elements,
             fmt::format("read [{}, {}) of a group of {}", offset, offset + count,
                         group ? group->elements : 0));
}

void Session::CallSteps(ByteReader& in) {
  const zoe_group_id id = PickGroup(in.U8());
  const int64_t steps = static_cast<int8_t>(in.U8());
  if (steps % 2 == 0) {
    (void)Checked(zoe_optim_group_set_steps(engine_, id, steps), "zoe_optim_group_set_steps");
    return;
  }
  int64_t out = 12345;
  if (Checked(zoe_optim_group_steps(engine_, id, &out), "zoe_optim_group_steps") != ZOE_OK) {
    FUZZ_CHECK(out == 0, "a failed step count left a value");
  }
}

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

// Every state array of every group, concatenated.
std::vector<float> Session::AllState() {
  std::vector<float> all;
  for (const GroupModel& group : groups_) {
    for (int slot = ZOE_STATE_MASTER; slot <= ZOE_STATE_EXP_AVG_SQ; ++slot) {
      std::vector<float> values(group.elements);
      (void)Checked(zoe_optim_state_read(engine_, group.id, static_cast<zoe_state_slot>(slot), 0,
                                         values.size(), values.data()),
                    "zoe_optim_state_read");
      all.insert(all.end(), values.begin(), values.end());
    }
  }
  return all;
}

void Session::CallCheckpoint(ByteReader& in, bool save) {
  static constexpr std::array<const char*, 3> kDirs = {"ckpt-a", "ckpt-b", "no-dir/ckpt"};
  const std::string dir = Path(kDirs[in.U8() % kDirs.size()]);
  if (!save) {
    (void)Checked(zoe_checkpoint_load(engine_, dir.c_str()), "zoe_checkpoint_load");
    return;
  }
  if (Checked(zoe_checkpoint_save(engine_, dir.c_str()), "zoe_checkpoint_save") != ZOE_OK) return;
  // What was just saved loads back and changes nothing (compared bit for bit: NaN is a value).
  const std::vector<float> before = AllState();
  const zoe_status loaded =
      Checked(zoe_checkpoint_load(engine_, dir.c_str()), "zoe_checkpoint_load");
  FUZZ_CHECK(loaded == ZOE_OK,
             std::string("a checkpoint just saved does not load: ") + zoe_last_error());
  const std::vector<float> after = AllState();
  FUZZ_CHECK(SameBits(after, before), "loading the checkpoint just saved changed the state");
}

void CheckJson(zoe_status status, char* json, std::string_view call) {
  if (Checked(status, call) != ZOE_OK) {
    FUZZ_CHECK(json == nullptr, fmt::format("a failed {} left a string", call));
    return;
  }
  FUZZ_CHECK(json != nullptr && json[0] == '{', std::string(call));
  zoe_free(json);
}

void Session::CallEngineQueries(ByteReader& in) {
  char* json = reinterpret_cast<char*>(uintptr_t{1});
  switch (in.U8() % 4) {
    case 0:
      CheckJson(zoe_engine_stats_json(engine_, &json), json, "zoe_engine_stats_json");
      break;
    case 1:
      CheckJson(zoe_engine_config_json(engine_, &json), json, "zoe_engine_config_json");
      break;
    case 2:
      (void)Checked(zoe_engine_async_error(engine_), "zoe_engine_async_error");
      break;
    default:
      (void)Checked(zoe_engine_flush(engine_), "zoe_engine_flush");
      break;
  }
}

// A NULL engine or a NULL required pointer is INVALID_ARGUMENT (zoe.h, convention 6).
void Session::CallNullArguments(ByteReader& in) {
  zoe_tensor_desc desc = ZOE_TENSOR_DESC_INIT;
  desc.name = "n";
  desc.bytes = 64;
  desc.home = ZOE_TIER_HOST;
  zoe_tensor_id tensor = 0;
  zoe_group_id group = 0;
  void* ptr = nullptr;
  zoe_status status = ZOE_OK;
  switch (in.U8() % 10) {
    case 0:
      status = zoe_tensor_register(nullptr, &desc, &tensor);
      break;
    case 1:
      status = zoe_tensor_register(engine_, nullptr, &tensor);
      break;
    case 2:
      status = zoe_tensor_register(engine_, &desc, nullptr);
      break;
    case 3:
      status =
          zoe_tensor_acquire(engine_, PickTensor(in.U8()), ZOE_TIER_HOST, ZOE_ACCESS_READ, nullptr);
      break;
    case 4:
      status = zoe_optim_group_create(engine_, nullptr, nullptr, 0, &group);
      break;
    case 5:
      status = zoe_optim_group_create(engine_, "{\"name\": \"z\"}", nullptr, 3, &group);
      break;
    case 6:
      status = zoe_engine_stats_json(engine_, nullptr);
      break;
    case 7:
      status = zoe_optim_group_steps(engine_, PickGroup(in.U8()), nullptr);
      break;
    case 8:
      status = zoe_trace_save(engine_, "forward", nullptr);
      break;
    default:
      status = zoe_tensor_acquire(nullptr, 0, ZOE_TIER_HOST, ZOE_ACCESS_READ, &ptr);
      break;
  }
  FUZZ_CHECK(Checked(status, "a call with a NULL argument") == ZOE_ERR_INVALID_ARGUMENT,
             zoe_last_error());
}

void Session::Call(ByteReader& in) {
  switch (in.U8() % 20) {
    case 0:
      CallRegister(in);
      break;
    case 1:
      CallFind(in);
      break;
    case 2:
      CallAcquire(in);
      break;
    case 3:
      CallRelease(in);
      break;
    case 4:
      CallPrefetchOrEvict(in, /*evict=*/false);
      break;
    case 5:
      CallPrefetchOrEvict(in, /*evict=*/true);
      break;
    case 6:
      CallTraceBeginEnd(in, /*begin=*/true);
      break;
    case 7:
      CallTraceBeginEnd(in, /*begin=*/false);
      break;
    case 8:
      CallTraceSave(in);
      break;
    case 9:
      CallTraceLoad(in);
      break;
    case 10:
      CallGroupCreate(in);
      break;
    case 11:
      CallStep(in);
      break;
    case 12:
      CallAccumulate(in);
      break;
    case 13:
      CallState(in, /*write=*/false);
      break;
    case 14:
      CallState(in, /*write=*/true);
      break;
    case 15:
      CallSteps(in);
      break;
    case 16:
      CallCheckpoint(in, /*save=*/true);
      break;
    case 17:
      CallCheckpoint(in, /*save=*/false);
      break;
    case 18:
      CallEngineQueries(in);
      break;
    default:
      CallNullArguments(in);
      break;
  }
}

// Small budgets so that eviction, write-back and NVMe state are reached within a few calls: the
// tensors' HOST tier holds 8 chunks of 16 KiB, the device 4; optimizer sub-groups of 256.
std::string EngineConfig(uint8_t choice, const std::string& root) {
  const bool nvme_state = choice & 1;
  return fmt::format(
      R"({{"zero_optimization": {{"sub_group_size": 256, "offload_optimizer": {{"device": "{}",)"
      R"( "nvme_path": "{}/nvme"}}}},)"
      R"( "zoe": {{"device": "host", "chunk_size": {}, "host_budget": "4M",)"
      R"( "tensor_host_budget": {}, "device_budget": {}, "tensor_swap_bytes": "1M",)"
      R"( "checksum": {}, "eviction": "{}", "moment_dtype": "{}"}}}})",
      nvme_state ? "nvme" : "cpu", root, kChunkBytes, 8 * kChunkBytes, 4 * kChunkBytes,
      (choice & 2) ? "true" : "false", (choice & 4) ? "lru" : "opt",
      (choice & 8) ? "bf16" : "fp32");
}

}  // namespace
}  // namespace zoe::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace zoe::fuzz;
  ByteReader in(data, size);
  const std::string root = ResetScratch();
  const std::string config = EngineConfig(in.U8(), root);
  FUZZ_CHECK(Checked(zoe_config_check(config.c_str(), nullptr), "check") == ZOE_OK,
             config + ": " + zoe_last_error());
  char* normalized = nullptr;
  FUZZ_CHECK(Checked(zoe_config_normalize(config.c_str(), &normalized), "normalize") == ZOE_OK,
             config + ": " + zoe_last_error());
  zoe_free(normalized);
  zoe_engine* engine = reinterpret_cast<zoe_engine*>(uintptr_t{1});
  const zoe_status created = Checked(zoe_engine_create(config.c_str(), &engine), "create");
  FUZZ_CHECK(created == ZOE_OK, config + ": " + zoe_last_error());
  Session session(engine, root);
  session.Run(in);
  return 0;
}
