#include "apps/bench_util.h"

#include <fmt/format.h>

#include <httplib.h>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <thread>
#include <vector>

#include "rolloutcore/net/http.h"

namespace rc::apps {

Result<Json> BenchCall(int port, const std::string& method, const std::string& path, const Json& body, int timeout_s) {
  httplib::Client c("127.0.0.1", port);
  net::ApplyClientPolicy(c);  // the bench's children require $ROLLOUTCORE_API_KEY when it is set
  c.set_read_timeout(timeout_s, 0);
  auto r = method == "GET" ? c.Get(path.c_str()) : c.Post(path.c_str(), body.dump(), "application/json");
  if (!r) return Unavailable(method + " " + path + ": " + httplib::to_string(r.error()));
  if (r->status != 200) return Internal(method + " " + path + " answered " + std::to_string(r->status) + ": " + r->body);
  return ParseJson(r->body, path);
}

Result<std::unique_ptr<ChildProcess>> SpawnDeltaTrainer(const std::string& name, const std::string& model, int ranks,
                                                       const std::string& dir_url, const std::string& transport,
                                                       double fraction, const std::string& log_path, int wait_s,
                                                       int* port) {
  RC_ASSIGN_OR_RETURN(*port, FreePort());
  RC_ASSIGN_OR_RETURN(auto t, ChildProcess::Spawn("trainer-" + name,
                                                  {"trainer", "serve", "--model", model, "--name", name, "--layout",
                                                   "fsdp:" + std::to_string(ranks), "--directory", dir_url,
                                                   "--transport", transport, "--keep", "1", "--change-fraction",
                                                   fmt::format("{}", fraction), "--delta", "--port",
                                                   std::to_string(*port)},
                                                  log_path));
  RC_RETURN_IF_ERROR(BenchWaitHealthy(t.get(), *port, "/status", wait_s));
  return t;
}

Status BenchWaitHealthy(ChildProcess* c, int port, const std::string& path, int seconds) {
  httplib::Client cli("127.0.0.1", port);
  for (int i = 0; i < seconds * 100; ++i) {
    if (!c->Alive()) return Unavailable(c->name() + " exited:\n" + c->LogTail());
    auto r = cli.Get(path.c_str());
    if (r && r->status == 200) return OkStatus();
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return DeadlineExceeded(c->name() + " not healthy after " + std::to_string(seconds) + " s:\n" + c->LogTail());
}

double MemcpyGbps(uint64_t bytes) {
  std::vector<char> a(bytes, 1), b(bytes, 0);
  double best = 0;
  for (int i = 0; i < 3; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    std::memcpy(b.data(), a.data(), bytes);
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, static_cast<double>(bytes) / s / 1e9);
  }
  return best;
}

double MemcpyGbpsThreads(uint64_t bytes, int threads) {
  if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  std::vector<char> a(bytes, 1), b(bytes, 0);
  const uint64_t chunk = (bytes + static_cast<uint64_t>(threads) - 1) / static_cast<uint64_t>(threads);
  double best = 0;
  for (int i = 0; i < 3; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    std::vector<std::thread> ts;
    for (int t = 0; t < threads; ++t) {
      const uint64_t begin = std::min(bytes, chunk * static_cast<uint64_t>(t));
      const uint64_t end = std::min(bytes, begin + chunk);
      ts.emplace_back([&, begin, end] { std::memcpy(b.data() + begin, a.data() + begin, end - begin); });
    }
    for (auto& t : ts) t.join();
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, static_cast<double>(bytes) / s / 1e9);
  }
  return best;
}

MemcpyPairing::MemcpyPairing(uint64_t bytes, int threads)
    : bytes_(bytes),
      threads_(threads > 0 ? threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()))),
      a_(bytes, 1),
      b_(bytes, 0) {}

double MemcpyPairing::CopyMs() {
  const uint64_t chunk = (bytes_ + static_cast<uint64_t>(threads_) - 1) / static_cast<uint64_t>(threads_);
  auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> ts;
  for (int t = 0; t < threads_; ++t) {
    const uint64_t begin = std::min(bytes_, chunk * static_cast<uint64_t>(t));
    const uint64_t end = std::min(bytes_, begin + chunk);
    ts.emplace_back([this, begin, end] { std::memcpy(b_.data() + begin, a_.data() + begin, end - begin); });
  }
  for (auto& t : ts) t.join();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

int ExecPythonModule(const std::string& module, const std::vector<std::string>& args, const std::string& what,
                     const std::string& needs) {
  const char* py = std::getenv("RC_PYTHON");
  std::vector<std::string> argv_s = {py != nullptr && *py != '\0' ? py : "python3", "-m", module};
  argv_s.insert(argv_s.end(), args.begin(), args.end());
  std::error_code ec;
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    if (std::getenv("ROLLOUTCORE_BIN") == nullptr) ::setenv("ROLLOUTCORE_BIN", self.c_str(), 1);
    // <build>/src/apps/rolloutcore -> <build>/python; <bundle>/bin/rolloutcore -> <bundle>/python.
    for (const auto& dir : {self.parent_path().parent_path().parent_path() / "python",
                            self.parent_path().parent_path() / "python"}) {
      if (!std::filesystem::exists(dir / "rolloutcore" / "__init__.py", ec)) continue;
      const char* old = std::getenv("PYTHONPATH");
      const std::string path = old != nullptr && *old != '\0' ? dir.string() + ":" + old : dir.string();
      ::setenv("PYTHONPATH", path.c_str(), 1);
      break;
    }
  }
  std::vector<char*> argv;
  argv.reserve(argv_s.size() + 1);
  for (auto& a : argv_s) argv.push_back(a.data());
  argv.push_back(nullptr);
  std::cout.flush();
  ::execvp(argv[0], argv.data());
  std::cerr << what << ": cannot run " << argv_s[0] << " -m " << module << ": " << std::strerror(errno)
            << " (set RC_PYTHON to a Python with " << needs << ")\n";
  return 127;
}

}  // namespace rc::apps
