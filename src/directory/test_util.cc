#include "directory/test_util.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <httplib.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

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
  if (pid_ > 0) Kill(SIGKILL);
  if (stdout_fd_ >= 0) ::close(stdout_fd_);
}

Status ChildProcess::Start(const std::vector<std::string>& argv, const std::string& stderr_path) {
  if (pid_ > 0) return FailedPrecondition("child already running");
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) return Internal("pipe2 failed");
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) {
    ::close(fds[0]);
    ::close(fds[1]);
    return Internal("fork failed");
  }
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(127);
    ::dup2(fds[1], STDOUT_FILENO);
    if (!stderr_path.empty()) {
      const int err = ::open(stderr_path.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
      if (err >= 0) ::dup2(err, STDERR_FILENO);
    }
    std::vector<char*> args;
    for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    ::execv(args[0], args.data());
    ::_exit(127);
  }
  ::close(fds[1]);
  stdout_fd_ = fds[0];
  pid_ = pid;
  buffer_.clear();
  return OkStatus();
}

Result<std::string> ChildProcess::ReadLineContaining(const std::string& needle, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (true) {
    size_t nl;
    while ((nl = buffer_.find('\n')) != std::string::npos) {
      std::string line = buffer_.substr(0, nl);
      buffer_.erase(0, nl + 1);
      if (line.find(needle) != std::string::npos) return line;
    }
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0 || stdout_fd_ < 0) {
      return DeadlineExceeded(fmt::format("child {} printed no line containing '{}'", pid_, needle));
    }
    pollfd p{stdout_fd_, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) continue;
    char buf[4096];
    const ssize_t n = ::read(stdout_fd_, buf, sizeof buf);
    if (n <= 0) return Unavailable(fmt::format("child {} closed stdout before printing '{}'", pid_, needle));
    buffer_.append(buf, static_cast<size_t>(n));
  }
}

int ChildProcess::Kill(int sig) {
  if (pid_ <= 0) return -1;
  ::kill(pid_, sig);
  int status = 0;
  ::waitpid(pid_, &status, 0);
  pid_ = -1;
  if (stdout_fd_ >= 0) {
    ::close(stdout_fd_);
    stdout_fd_ = -1;
  }
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
