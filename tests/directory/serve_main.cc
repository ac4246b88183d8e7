// A binary with only the `directory` subcommand of `rolloutcore` (the same RegisterDirectoryCommand),
// used by the restart tests.
#include <CLI/CLI.hpp>

#include "apps/commands.h"
#include "rolloutcore/base/log.h"

int main(int argc, char** argv) {
  rc::InitLoggingFromEnv();
  CLI::App app{"rolloutcore directory (test build)"};
  app.require_subcommand(1);
  int exit_code = 0;
  rc::apps::RegisterDirectoryCommand(app, &exit_code);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  return exit_code;
}
