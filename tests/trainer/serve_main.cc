// A binary with only the `trainer` subcommand of `rolloutcore` (the same RegisterTrainerCommand),
// so the trainer's e2e and fault tests do not depend on every other module of the binary building.
#include <CLI/CLI.hpp>

#include "apps/commands.h"
#include "rolloutcore/base/log.h"

int main(int argc, char** argv) {
  rc::InitLoggingFromEnv();
  CLI::App app{"rolloutcore trainer (test build)"};
  app.require_subcommand(1);
  int exit_code = 0;
  rc::apps::RegisterTrainerCommand(app, &exit_code);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  return exit_code;
}
