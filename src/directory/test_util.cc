#include "directory/test_util.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <httplib.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <thread>

#include "rolloutcore/base/hash.h"

namespace rc::directory::testing {

namespace {

uint64_t BoxDigest(int tensor, int64_t row0, int64_t rows) {
  return Mix64(static_cast<uint64_t>(tensor) * 1'000'003 + static_cast<uint64_t>(row0) * 7919 +
               static_cast<uint64_t>(rows));
}

}  // namespace

std::vector<refit::ShardTable> RowShardTables(int32_t rank, int32_t ranks, int tensors, int64_t rows, int64_t cols) {
  std::vector<refit::ShardTable> out;
  for (int t = 0; t < tensors; ++t) {
    refit::ShardTable table;
    table.name = fmt::format("w{}", t);
    table.dtype = refit::DType::kBF16;
    table.shape = {rows, cols};
    const int64_t begin = rows * rank / ranks, end = rows * (rank + 1) / ranks;
    if (end > begin) {
      refit::ShardInfo s;
      s.rank = rank;
      s.offset = {begin, 0};
      s.shape = {end - begin, cols};
      s.handle = fmt::format("shm://rank{}/w{}", rank, t);
      s.digest = BoxDigest(t, begin, end - begin);
      table.shards.push_back(std::move(s));
    }
    out.push_back(std::move(table));
  }
  return out;
}

std::vector<refit::ShardTable> ReplicaTables(int32_t rank, int tensors, int64_t rows, int64_t cols) {
  auto out = RowShardTables(0, 1, tensors, rows, cols);
  for (auto& t : out) {
    for (auto& s : t.shards) {
      s.rank = rank;
      s.handle = fmt::format("shm://rank{}/{}", rank, t.name);
    }
  }
  return out;
}

PublishRequest MakePublish(const std::string& model, const std::string& version, int32_t rank, int32_t ranks,
                           int64_t lease_ttl_ms) {
  PublishRequest r;
  r.model = model;
  r.version = version;
  r.rank = rank;
  r.expected_ranks = ranks;
  r.lease_ttl_ms = lease_ttl_ms;
  r.tables = RowShardTables(rank, ranks);
  return r;
}

int FreeLoopbackPort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return 0;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  int port = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0) {
    socklen_t len = sizeof addr;
    if (::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) port = ntohs(addr.sin_port);
  }
  ::close(fd);
  return port;
}

std::string MakeTempDir(const std::string& prefix) {
  const char* tmp = std::getenv("TMPDIR");
  std::string templ = fmt::format("{}/{}-XXXXXX", tmp && *tmp ? tmp : "/tmp", prefix);
  std::vector<char> buf(templ.begin(), templ.end());
  buf.push_back('\0');
  const char* dir = ::mkdtemp(buf.data());
  return dir ? std::string(dir) : std::string();
}

void RemoveTree(const std::string& path) {
  std::error_code ec;
  if (!path.empty()) std::filesystem::remove_all(path, ec);
}

std::string FindOnPath(const std::string& name) {
  const char* path = std::getenv("PATH");
  std::string dirs = path ? path : "/usr/local/bin:/usr/bin:/bin";
  size_t start = 0;
  while (start <= dirs.size()) {
    size_t end = dirs.find(':', start);
    if (end == std::string::npos) end = dirs.size();
    const std::string candidate = dirs.substr(start, end - start) + "/" + name;
    if (end > start && ::access(candidate.c_str(), X_OK) == 0) return candidate;
    start = end + 1;
  }
  return "";
}

ChildProcess::~ChildProcess() {
  if (proc_) Kill(SIGKILL);
}

Status ChildProcess::Start(const std::vector<std::string>& argv, const std::string& stderr_path) {
  if (proc_) return FailedPrecondition("child already running");
  SubprocessOptions o;
  o.argv = argv;
  o.stdout_io = ChildIo::kPipe;
  if (!stderr_path.empty()) {
    o.stderr_io = ChildIo::kFile;
    o.stderr_path = stderr_path;
  }
  o.parent_death_signal = SIGKILL;
  RC_ASSIGN_OR_RETURN(proc_, Subprocess::Spawn(o));
  return OkStatus();
}

Result<std::string> ChildProcess::ReadLineContaining(const std::string& needle, std::chrono::milliseconds timeout) {
  if (!proc_) return FailedPrecondition("child not running");
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (true) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    auto line = proc_->ReadLine(std::max(left, std::chrono::milliseconds(0)));
    if (line.ok()) {
      if (line->find(needle) != std::string::npos) return line;
      continue;
    }
    if (line.status().code() == StatusCode::kDeadlineExceeded) {
      return DeadlineExceeded(fmt::format("child {} printed no line containing '{}'", proc_->pid(), needle));
    }
    return Unavailable(fmt::format("child {} closed stdout before printing '{}'", proc_->pid(), needle));
  }
}

int ChildProcess::Kill(int sig) {
  if (!proc_) return -1;
  proc_->Signal(sig);
  (void)proc_->Wait(std::chrono::milliseconds(-1));
  const int status = proc_->wait_status();
  proc_.reset();
  return status;
}

Result<std::unique_ptr<EtcdProcess>> EtcdProcess::Start() {
  const std::string binary = FindOnPath("etcd");
  if (binary.empty()) {
    return Unavailable("the `etcd` binary is not installed (Debian package etcd-server; scripts/install-deps.sh)");
  }
  Status last = OkStatus();
  for (int attempt = 0; attempt < 3; ++attempt) {
    std::unique_ptr<EtcdProcess> etcd(new EtcdProcess());
    etcd->data_dir_ = MakeTempDir("rc-etcd");
    const int client_port = FreeLoopbackPort(), peer_port = FreeLoopbackPort();
    const std::string client = fmt::format("http://127.0.0.1:{}", client_port);
    const std::string peer = fmt::format("http://127.0.0.1:{}", peer_port);
    Status s = etcd->process_.Start(
        {binary, "--name", "rc-test", "--data-dir", etcd->data_dir_ + "/data", "--listen-client-urls", client,
         "--advertise-client-urls", client, "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
         "--initial-cluster", "rc-test=" + peer, "--heartbeat-interval", "10", "--election-timeout", "100",
         "--logger", "zap", "--log-level", "error"},
        etcd->data_dir_ + "/etcd.log");
    if (!s.ok()) return s;
    etcd->endpoint_ = client;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(15);
    while (std::chrono::steady_clock::now() < deadline) {
      httplib::Client c(client);
      c.set_connection_timeout(0, 200'000);
      auto res = c.Get("/health");
      if (res && res->status == 200 && res->body.find("true") != std::string::npos) return etcd;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    last = Unavailable(fmt::format("etcd at {} did not become healthy (log in {})", client, etcd->data_dir_));
  }
  return last;
}

EtcdProcess::~EtcdProcess() {
  process_.Kill(SIGKILL);
  RemoveTree(data_dir_);
}

}  // namespace rc::directory::testing
