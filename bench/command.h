// Subcommands of the zoe CLI register themselves here, one file each, so adding a command touches
// no other file: a static CommandRegistrar in the command's file adds it before main runs.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>
#include <string>
#include <vector>

namespace zoe::cli {

// Where a command attaches: the top level ("zoe info") or under "zoe bench" ("zoe bench io").
enum class Parent { kRoot, kBench };

struct Command {
  Parent parent;
  // Adds the subcommand, its options and its callback to `parent_app`. The callback runs after
  // parsing; it sets the process exit status through SetExitCode.
  std::function<void(CLI::App& parent_app)> attach;
};

std::vector<Command>& Registry();

struct CommandRegistrar {
  explicit CommandRegistrar(Command command) { Registry().push_back(std::move(command)); }
};

// The exit status main returns (0 unless a command set one).
void SetExitCode(int code);
int ExitCode();

}  // namespace zoe::cli
