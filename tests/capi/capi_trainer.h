// A small training loop over the C API for the tests of what an engine holds in its process:
// an engine whose tensors and optimizer state live on NVMe (one swap directory), eight tensors
// written and read back through HOST, and one AdamW group stepped with deterministic gradients.
// Every method returns "" or what failed (with zoe_last_error()), so it also runs in a forked
// child, where gtest assertions would not reach the parent.
#pragma once

#include <sys/stat.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "zoe.h"

namespace zoe::capi_testing {

inline constexpr int kTensors = 8;
inline constexpr uint64_t kTensorBytes = 16 * 1024;
inline constexpr size_t kParams = 4096;

// The configuration: HOST holds four chunks of tensors, so eight tensors go through NVMe; the
// optimizer state is on NVMe in sub-groups of 1024 elements.
inline std::string NvmeConfig(const std::string& nvme_dir) {
  return R"({"zero_optimization": {"sub_group_size": 1024, "offload_optimizer": {"device": "nvme", )"
         R"("nvme_path": ")" +
         nvme_dir +
         R"("}}, "zoe": {"chunk_size": 65536, "host_budget": "64M", "tensor_host_budget": 262144, )"
         R"("tensor_swap_bytes": "4M", "device": "host", "device_budget": 131072, )"
         R"("log_level": "warn"}})";
}

// "what: STATUS: message" for a failed call, "" for ZOE_OK.
inline std::string Failed(zoe_status status, const std::string& what) {
  if (status == ZOE_OK) return "";
  return what + ": " + zoe_status_string(status) + ": " + zoe_last_error() + "\n";
}

inline unsigned char TensorByte(int tensor, size_t i, unsigned round) {
  return static_cast<unsigned char>((i * 31u + static_cast<unsigned>(tensor) * 7u + round) & 0xff);
}

class Trainer {
 public:
  // Creates the directory `nvme_dir` and the engine; check error() afterwards.
  explicit Trainer(const std::string& nvme_dir) {
    ::mkdir(nvme_dir.c_str(), 0700);
    error_ = Failed(zoe_engine_create(NvmeConfig(nvme_dir).c_str(), &engine_), "create");
    for (int t = 0; error_.empty() && t < kTensors; ++t) {
      const std::string name = "t" + std::to_string(t);
      zoe_tensor_desc desc = ZOE_TENSOR_DESC_INIT;
      desc.name = name.c_str();
      desc.bytes = kTensorBytes;
      error_ += Failed(zoe_tensor_register(engine_, &desc, &tensors_[t]), "register " + name);
    }
    std::vector<float> params(kParams);
    for (size_t i = 0; i < kParams; ++i) params[i] = std::sin(0.01f * static_cast<float>(i));
    zoe_buffer_view view{params.data(), ZOE_DTYPE_FLOAT32, kParams};
    if (error_.empty())
      error_ = Failed(
          zoe_optim_group_create(engine_, R"({"name": "g", "type": "AdamW"})", &view, 1, &group_),
          "group create");
  }
  ~Trainer() { zoe_engine_destroy(engine_); }
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  zoe_engine* engine() const { return engine_; }
  zoe_tensor_id tensor(int t) const { return tensors_[t]; }
  zoe_group_id group() const { return group_; }
  const std::string& error() const { return error_; }

  // One optimizer step with gradients that depend on `round`.
  std::string Step(unsigned round) {
    std::vector<float> grads(kParams);
    for (size_t i = 0; i < kParams; ++i)
      grads[i] = std::cos(0.003f * static_cast<float>(i * (round + 1)));
    zoe_buffer_view view{grads.data(), ZOE_DTYPE_FLOAT32, kParams};
    zoe_hyper_params hyper = ZOE_HYPER_PARAMS_INIT;
    hyper.lr = 1e-2;
    hyper.weight_decay = 0.01;
    return Failed(zoe_optim_step(engine_, group_, &hyper, &view, 1, nullptr, 0, 1.0, nullptr),
                  "step " + std::to_string(round));
  }

  // Writes every tensor's bytes for `round` and evicts it, so it goes down to NVMe.
  std::string WriteTensors(unsigned round) {
    std::string out;
    for (int t = 0; out.empty() && t < kTensors; ++t) {
      void* ptr = nullptr;
      out += Failed(zoe_tensor_acquire(engine_, tensors_[t], ZOE_TIER_HOST, ZOE_ACCESS_WRITE, &ptr),
                    "acquire for write");
      if (!out.empty()) break;
      auto* bytes = static_cast<unsigned char*>(ptr);
      for (size_t i = 0; i < kTensorBytes; ++i) bytes[i] = TensorByte(t, i, round);
      out += Failed(zoe_tensor_release(engine_, tensors_[t]), "release");
      out += Failed(zoe_tensor_evict(engine_, tensors_[t]), "evict");
    }
    return out;
  }

  // Reads every tensor back and compares it with what WriteTensors(round) wrote.
  std::string CheckTensors(unsigned round) {
    std::string out;
    for (int t = 0; out.empty() && t < kTensors; ++t) {
      void* ptr = nullptr;
      out += Failed(zoe_tensor_acquire(engine_, tensors_[t], ZOE_TIER_HOST, ZOE_ACCESS_READ, &ptr),
                    "acquire for read");
      if (!out.empty()) break;
      const auto* bytes = static_cast<const unsigned char*>(ptr);
      for (size_t i = 0; i < kTensorBytes && out.empty(); ++i) {
        if (bytes[i] != TensorByte(t, i, round))
          out = "tensor t" + std::to_string(t) + " byte " + std::to_string(i) + " differs\n";
      }
      out += Failed(zoe_tensor_release(engine_, tensors_[t]), "release");
    }
    return out;
  }

  // The group's state array `slot` into `out`.
  std::string ReadState(zoe_state_slot slot, std::vector<float>* out) {
    out->assign(kParams, 0.0f);
    return Failed(zoe_optim_state_read(engine_, group_, slot, 0, kParams, out->data()),
                  "state read");
  }

 private:
  zoe_engine* engine_ = nullptr;
  zoe_tensor_id tensors_[kTensors] = {};
  zoe_group_id group_ = ZOE_GROUP_ID_INVALID;
  std::string error_;
};

}  // namespace zoe::capi_testing
