// `rolloutcore directory ...`: serve the version directory, and a few operator commands that talk
// to a running one (list, get, release, mark-unavailable). HTTP API: docs/directory.md.
#include <fmt/format.h>
#include <signal.h>

#include <cstdio>
#include <iostream>
#include <memory>

#include "apps/cli_checks.h"
#include "apps/commands.h"
#include "apps/server_flags.h"
#include "apps/stop_signals.h"
#include "directory/codec.h"
#include "rolloutcore/directory/client.h"
#include "rolloutcore/directory/server.h"
#include "rolloutcore/directory/store.h"

namespace rc::apps {
namespace {

struct ServeOptions {
  std::string store = "memory";
  std::string host = "127.0.0.1";
  int port = 7470;
  int64_t max_wait_ms = 60'000;
  net::ServerSecurity security;
};

int Serve(const ServeOptions& o) {
  const StopSignals stop_signals;  // before any thread starts

  auto store = directory::OpenDirectoryStore(o.store);
  if (!store.ok()) {
    fmt::print(stderr, "directory: cannot open store '{}': {}\n", o.store, store.status().ToString());
    return 1;
  }
  directory::ServerOptions options;
  options.host = o.host;
  options.port = o.port;
  options.max_wait_ms = o.max_wait_ms;
  options.store_kind = o.store.substr(0, o.store.find(':'));
  options.security = o.security;
  directory::DirectoryServer server(store->get(), options);
  Status s = server.Start();
  if (!s.ok()) {
    fmt::print(stderr, "directory: {}\n", s.ToString());
    return 1;
  }
  fmt::print("directory listening on {} (store {})\n", server.url(), o.store);
  std::fflush(stdout);
  const int sig = stop_signals.Wait();
  fmt::print(stderr, "directory: signal {}, stopping\n", sig);
  server.Stop();
  return 0;
}

int PrintResult(const Result<Json>& r) {
  if (!r.ok()) {
    fmt::print(stderr, "directory: {}\n", r.status().ToString());
    return r.status().code() == StatusCode::kNotFound ? 3 : 1;
  }
  fmt::print("{}\n", r->dump(2));
  return 0;
}

}  // namespace

void RegisterDirectoryCommand(CLI::App& app, int* exit_code) {
  auto* dir = app.add_subcommand(
      "directory", "The version directory: trainer ranks publish shard tables, engines discover committed versions.");
  dir->require_subcommand(1);

  auto serve_opts = std::make_shared<ServeOptions>();
  auto* serve = dir->add_subcommand("serve", "Serve the directory's HTTP/JSON API (docs/directory.md).");
  serve->add_option("--store", serve_opts->store, "memory | sqlite:PATH | etcd:URL[,URL...][/PREFIX] (several URLs: members of one etcd cluster, with failover)")->capture_default_str();
  serve->add_option("--host", serve_opts->host, "Address to bind (loopback by default)")->capture_default_str();
  serve->add_option("--port", serve_opts->port, "Port to bind (0: any free port; the URL is printed)")
      ->check(CLI::Range(0, 65535))
      ->capture_default_str();
  serve->add_option("--max-wait-ms", serve_opts->max_wait_ms, "Longest long-poll a client may ask for")
      ->check(CLI::Range(int64_t{0}, int64_t{3'600'000}))
      ->capture_default_str();
  AddServerSecurityFlags(serve, &serve_opts->security);
  serve->callback([serve_opts, exit_code] {
    if (Status s = ResolveServerSecurity(&serve_opts->security); !s.ok()) {
      std::cerr << "directory serve: " << s.ToString() << "\n";
      *exit_code = 2;
      return;
    }
    *exit_code = Serve(*serve_opts);
  });

  struct ClientOpts {
    std::string url = "http://127.0.0.1:7470";
    std::string model;
    std::string version;
    std::string state = "committed";
    std::string reason;
  };
  auto copts = std::make_shared<ClientOpts>();
  auto* list = dir->add_subcommand("list", "List the versions of a model (JSON).");
  auto* get = dir->add_subcommand("get", "Print the committed manifest of a version (JSON).");
  auto* release = dir->add_subcommand("release", "Release a version (it disappears from list and get).");
  auto* mark = dir->add_subcommand(
      "mark-unavailable",
      "Record that a version's sources are gone: COMMITTED becomes UNAVAILABLE (refused by get), STAGING ABANDONED.");
  for (CLI::App* c : {list, get, release, mark}) {
    c->add_option("--url", copts->url, "Directory URL")->check(HttpUrl())->capture_default_str();
    c->add_option("--model", copts->model, "Model name")->required();
  }
  for (CLI::App* c : {get, release, mark}) c->add_option("--version", copts->version, "Version label")->required();
  mark->add_option("--reason", copts->reason, "Whose memory is gone and why (recorded)")->required();
  list->add_option("--state", copts->state, "committed | staging | abandoned | unavailable | all")
      ->capture_default_str();

  list->callback([copts, exit_code] {
    auto filter = directory::ParseStateFilter(copts->state);
    if (!filter.ok()) {
      *exit_code = PrintResult(filter.status());
      return;
    }
    directory::DirectoryClient client(copts->url);
    auto versions = client.List(copts->model, *filter);
    if (!versions.ok()) {
      *exit_code = PrintResult(versions.status());
      return;
    }
    Json out = Json::array();
    for (const auto& v : *versions) out.push_back(directory::internal::VersionInfoToJson(v));
    *exit_code = PrintResult(out);
  });
  get->callback([copts, exit_code] {
    directory::DirectoryClient client(copts->url);
    auto m = client.Get(copts->model, copts->version);
    *exit_code = m.ok() ? PrintResult(refit::ManifestToJson(*m)) : PrintResult(m.status());
  });
  release->callback([copts, exit_code] {
    directory::DirectoryClient client(copts->url);
    Status s = client.Release(copts->model, copts->version);
    *exit_code = s.ok() ? PrintResult(Json{{"released", true}}) : PrintResult(s);
  });
  mark->callback([copts, exit_code] {
    directory::DirectoryClient client(copts->url);
    Status s = client.MarkUnavailable(copts->model, copts->version, copts->reason);
    if (!s.ok()) {
      *exit_code = PrintResult(s);
      return;
    }
    auto info = client.GetInfo(copts->model, copts->version);
    *exit_code = info.ok() ? PrintResult(directory::internal::VersionInfoToJson(*info)) : PrintResult(info.status());
  });
}

}  // namespace rc::apps
