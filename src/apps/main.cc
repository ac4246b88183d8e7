// The `rolloutcore` command line: one binary, one subcommand per job.
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <iostream>
#include <string>
#include <vector>

#include "apps/commands.h"
#include "rolloutcore/base/log.h"
#include "rolloutcore/base/version.h"

namespace {

// "rolloutcore nosuch" or "rolloutcore bench nosuch": CLI11 answers "A subcommand is required",
// which does not say that the word was not understood. The words up to the first option are walked
// down the command tree; the first that names no command of a group is reported with the group's
// commands. Empty when every word is a command (or the walk reaches a command that takes
// positional arguments).
std::string UnknownCommand(CLI::App& app, int argc, char** argv) {
  CLI::App* at = &app;
  std::string path = "rolloutcore";
  for (int i = 1; i < argc; ++i) {
    const std::string word = argv[i];
    if (word.empty() || word[0] == '-') return "";
    const std::vector<CLI::App*> subs = at->get_subcommands([](CLI::App*) { return true; });
    if (subs.empty()) return "";
    CLI::App* next = nullptr;
    std::string names;
    for (CLI::App* sub : subs) {
      if (sub->get_name() == word) next = sub;
      if (!sub->get_group().empty()) names += (names.empty() ? "" : ", ") + sub->get_name();
    }
    if (next == nullptr) {
      return fmt::format("unknown command '{}' for `{}`; its commands are: {} (`{} --help` says what each does)", word,
                         path, names, path);
    }
    at = next;
    path += " " + word;
  }
  return "";
}

}  // namespace

int main(int argc, char** argv) {
  rc::InitLoggingFromEnv();
  CLI::App app{
      "rolloutcore: safe, fast and provable weight updates for RL rollouts.\n"
      "Run `rolloutcore <command> --help` for the options of each command."};
  app.set_version_flag("--version", std::string("rolloutcore ") + rc::kVersion);
  app.require_subcommand(1);
  app.fallthrough(false);

  int exit_code = 0;
  rc::apps::RegisterSimulateCommand(app, &exit_code);
  rc::apps::RegisterPlanCommand(app, &exit_code);
  rc::apps::RegisterPlanFleetCommand(app, &exit_code);
  rc::apps::RegisterDirectoryCommand(app, &exit_code);
  rc::apps::RegisterControllerCommand(app, &exit_code);
  rc::apps::RegisterEngineCommand(app, &exit_code);
  rc::apps::RegisterModelCommand(app, &exit_code);
  rc::apps::RegisterBenchEngineCommand(app, &exit_code);
  rc::apps::RegisterTrainerCommand(app, &exit_code);
  rc::apps::RegisterDemoCommand(app, &exit_code);
  rc::apps::RegisterBenchRefitCommand(app, &exit_code);
  rc::apps::RegisterBenchCycleCommands(app, &exit_code);
#ifdef ROLLOUTCORE_WITH_CUDA
  rc::apps::RegisterBenchGpuOwnerCommand(app, &exit_code);
#endif

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (const std::string why = UnknownCommand(app, argc, argv); !why.empty() && e.get_exit_code() != 0) {
      std::cerr << why << std::endl;
      return e.get_exit_code();
    }
    return app.exit(e);
  }
  return exit_code;
}
