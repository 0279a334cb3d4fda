#include "bench/io_fio.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <sstream>

namespace zoe::cli {
namespace {

std::string ShellQuote(const std::string& arg) {
  std::string out = "'";
  for (char c : arg) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

// Runs `args` and returns what it printed on stdout; its stderr goes to ours.
Result<std::string> Capture(const std::vector<std::string>& args) {
  std::string command;
  for (const auto& arg : args) command += ShellQuote(arg) + " ";
  FILE* pipe = ::popen(command.c_str(), "r");
  if (pipe == nullptr) return Status::FromErrno(errno, "run " + args.front());
  std::string out;
  char chunk[4096];
  size_t n;
  while ((n = std::fread(chunk, 1, sizeof chunk, pipe)) > 0) out.append(chunk, n);
  const int status = ::pclose(pipe);
  if (status != 0) {
    return Status::IoError(fmt::format("{} exited with status {}", command,
                                       WIFEXITED(status) ? WEXITSTATUS(status) : -1));
  }
  return out;
}

double Percentile(const nlohmann::json& clat, const char* key) {
  const auto& p = clat.value("percentile", nlohmann::json::object());
  return p.contains(key) ? p[key].get<double>() / 1000.0 : 0.0;
}

}  // namespace

std::string FindFio() {
  const char* path = std::getenv("PATH");
  std::stringstream dirs(path ? path : "/usr/bin:/bin");
  std::string dir;
  while (std::getline(dirs, dir, ':')) {
    const std::string candidate = dir + "/fio";
    if (::access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return {};
}

std::string FioEngineFor(const std::string& zoe_backend) {
  if (zoe_backend == "io_uring" || zoe_backend == "libaio") return zoe_backend;
  return "psync";
}

std::vector<std::string> FioArguments(const std::string& fio, const IoBenchSpec& spec,
                                      const std::string& ioengine,
                                      const std::vector<std::vector<std::string>>& files) {
  std::vector<std::string> args = {fio,
                                   "--output-format=json",
                                   "--group_reporting",
                                   "--thread",
                                   "--ioengine=" + ioengine,
                                   fmt::format("--direct={}", spec.direct ? 1 : 0),
                                   "--rw=" + spec.rw,
                                   fmt::format("--bs={}", spec.bs),
                                   fmt::format("--iodepth={}", spec.iodepth),
                                   fmt::format("--size={}", spec.size)};
  if (spec.runtime_s > 0) {
    args.push_back(fmt::format("--runtime={}", spec.runtime_s));
    args.push_back("--time_based");
  }
  for (size_t i = 0; i < files.size(); ++i) {
    args.push_back(fmt::format("--name=job{}", i));
    args.push_back(fmt::format("--filename={}", fmt::join(files[i], ":")));
  }
  return args;
}

Result<FioResult> ParseFioJson(const std::string& text, bool write) {
  const size_t begin = text.find('{');
  if (begin == std::string::npos) return Status::InvalidArgument("fio printed no JSON");
  nlohmann::json doc =
      nlohmann::json::parse(text.substr(begin), nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded() || !doc.contains("jobs") || doc["jobs"].empty()) {
    return Status::InvalidArgument("fio's JSON output has no jobs");
  }
  const nlohmann::json& side = doc["jobs"][0][write ? "write" : "read"];
  FioResult out;
  out.bw_bytes = side.value("bw_bytes", 0.0);
  out.iops = side.value("iops", 0.0);
  const nlohmann::json& clat = side.value("clat_ns", nlohmann::json::object());
  out.lat.p50 = Percentile(clat, "50.000000");
  out.lat.p90 = Percentile(clat, "90.000000");
  out.lat.p99 = Percentile(clat, "99.000000");
  out.lat.p999 = Percentile(clat, "99.900000");
  out.lat.max = side.value("lat_ns", nlohmann::json::object()).value("max", 0.0) / 1000.0;
  return out;
}

Result<FioResult> RunFio(const IoBenchSpec& spec, const std::string& zoe_backend,
                         const std::vector<std::vector<std::string>>& files) {
  const std::string fio = FindFio();
  if (fio.empty()) return Status::NotFound("fio is not installed (apt-get install fio)");
  const std::string ioengine = FioEngineFor(zoe_backend);
  const std::vector<std::string> args = FioArguments(fio, spec, ioengine, files);
  ZOE_ASSIGN_OR_RETURN(std::string text, Capture(args));
  ZOE_ASSIGN_OR_RETURN(FioResult result, ParseFioJson(text, IsWrite(spec.rw)));
  result.ioengine = ioengine;
  result.command = fmt::format("{}", fmt::join(args, " "));
  result.buffer_bytes = uint64_t{spec.jobs} * spec.iodepth * spec.bs;
  return result;
}

}  // namespace zoe::cli
