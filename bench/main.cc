// zoe: the command-line front end. A thin main over the commands in bench/*.cc.
#include <iostream>
#include <string>
#include <string_view>

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

namespace {

// The names of `app`'s subcommands, comma-separated.
std::string SubcommandNames(const CLI::App& app) {
  std::string names;
  for (const CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; })) {
    names += (names.empty() ? "" : ", ") + sub->get_name();
  }
  return names;
}

// The first word after `app`'s own arguments (argv[at]) when it names none of its subcommands:
// CLI11 would only say a subcommand is required. Returns whether it printed the error.
bool RefusedUnknownSubcommand(const CLI::App& app, int argc, char** argv, int at,
                              std::string_view path) {
  if (at >= argc || argv[at][0] == '-') return false;
  for (const CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; })) {
    if (sub->check_name(argv[at])) return false;
  }
  std::cerr << path << ": unknown command '" << argv[at] << "'; allowed: " << SubcommandNames(app)
            << " (" << path << " --help)\n";
  return true;
}

}  // namespace
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
  if (zoe::cli::RefusedUnknownSubcommand(app, argc, argv, 1, "zoe") ||
      (argc > 1 && std::string_view(argv[1]) == "bench" &&
       zoe::cli::RefusedUnknownSubcommand(*bench, argc, argv, 2, "zoe bench"))) {
    return 2;
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
