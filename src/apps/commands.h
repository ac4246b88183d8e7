// Subcommands of the `rolloutcore` command line. Each subcommand lives in its own file
// (<name>_cmd.cc) and is added to the CLI by one Register function listed in main.cc.
//
// A Register function adds its subcommand to `app` and sets a callback that stores the
// subcommand's exit code in *exit_code. Subcommands print human-readable output by default and
// JSON with --json where they offer it; errors go to stderr naming the bad input.
#pragma once

#include <CLI/CLI.hpp>

namespace rc::apps {

void RegisterSimulateCommand(CLI::App& app, int* exit_code);
void RegisterPlanCommand(CLI::App& app, int* exit_code);
void RegisterPlanFleetCommand(CLI::App& app, int* exit_code);
void RegisterDirectoryCommand(CLI::App& app, int* exit_code);
void RegisterControllerCommand(CLI::App& app, int* exit_code);
void RegisterEngineCommand(CLI::App& app, int* exit_code);
void RegisterModelCommand(CLI::App& app, int* exit_code);
void RegisterBenchEngineCommand(CLI::App& app, int* exit_code);
void RegisterTrainerCommand(CLI::App& app, int* exit_code);
void RegisterDemoCommand(CLI::App& app, int* exit_code);
void RegisterBenchRefitCommand(CLI::App& app, int* exit_code);
void RegisterBenchCycleCommands(CLI::App& app, int* exit_code);  // bench cycle, bench restart
#ifdef ROLLOUTCORE_WITH_CUDA
// The hidden trainer process of the GPU refit bench (bench_gpu_refit_cmd.cc).
void RegisterBenchGpuOwnerCommand(CLI::App& app, int* exit_code);
#endif

}  // namespace rc::apps
