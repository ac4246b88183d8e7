// The `rolloutcore` command line: one binary, one subcommand per job.
#include <CLI/CLI.hpp>

#include <iostream>

#include "apps/commands.h"
#include "rolloutcore/base/log.h"
#include "rolloutcore/base/version.h"

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
    return app.exit(e);
  }
  return exit_code;
}
