// zoe: the command-line front end. A thin main over the commands in bench/*.cc.
#include <iostream>

#include "bench/command.h"
#include "core/log.h"

namespace zoe::cli {

std::vector<Command>& Registry() {
  static std::vector<Command> commands;
  return commands;
}

namespace {
int exit_code = 0;
}
void SetExitCode(int code) { exit_code = code; }
int ExitCode() { return exit_code; }

}  // namespace zoe::cli

int main(int argc, char** argv) {
  CLI::App app{"zoe: heterogeneous-memory offload engine (GPU, pinned DRAM, NVMe)"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "zoe " ZOE_VERSION_STRING);
  CLI::App* bench = app.add_subcommand("bench", "measure I/O, optimizer and offload throughput");
  bench->require_subcommand(1);
  for (const auto& command : zoe::cli::Registry()) {
    command.attach(command.parent == zoe::cli::Parent::kBench ? *bench : app);
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const std::exception& e) {
    std::cerr << "zoe: " << e.what() << "\n";
    return 1;
  }
  return zoe::cli::ExitCode();
}
