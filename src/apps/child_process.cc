#include "apps/child_process.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <mutex>
#include <set>

#include "rolloutcore/base/mutex.h"

namespace rc::apps {
namespace {

rc::Mutex g_mu;
std::set<ChildProcess*> g_children GUARDED_BY(g_mu);  // guarded by g_mu

}  // namespace

Result<std::unique_ptr<ChildProcess>> ChildProcess::Spawn(const std::string& name,
                                                          const std::vector<std::string>& args,
                                                          const std::string& log_path, const std::string& exe_path) {
  std::string exe = exe_path;
  if (exe.empty()) {
    char self[4096];
    const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
    if (n <= 0) return Internal("cannot find my own executable (/proc/self/exe)");
    exe.assign(self, static_cast<size_t>(n));
  }
  SubprocessOptions o;
  o.argv = {exe};
  o.argv.insert(o.argv.end(), args.begin(), args.end());
  o.stdin_io = ChildIo::kNull;
  o.stdout_io = o.stderr_io = ChildIo::kFile;
  o.stdout_path = o.stderr_path = log_path;
  o.own_process_group = true;
  o.parent_death_signal = SIGTERM;
  auto proc = Subprocess::Spawn(o);
  if (!proc.ok()) return proc.status().WithContext(name);
  auto c = std::make_unique<ChildProcess>();
  c->name_ = name;
  c->log_path_ = log_path;
  c->proc_ = std::move(proc).value();
  rc::MutexLock lock(g_mu);
  g_children.insert(c.get());
  return c;
}

ChildProcess::~ChildProcess() {
  Stop();
  rc::MutexLock lock(g_mu);
  g_children.erase(this);
}

bool ChildProcess::Alive() { return proc_ && proc_->Alive(); }

int ChildProcess::Stop(int grace_ms) { return proc_ ? proc_->Terminate(std::chrono::milliseconds(grace_ms)) : 0; }

void ChildProcess::Kill() {
  if (proc_) proc_->Kill();
}

Status ChildProcess::Freeze(int timeout_ms) {
  if (!proc_) return FailedPrecondition(name_ + " is not running");
  return proc_->Freeze(std::chrono::milliseconds(timeout_ms)).WithContext(name_);
}

void ChildProcess::Thaw() {
  if (proc_) proc_->Thaw();
}

std::string ChildProcess::LogTail(size_t lines) const {
  std::ifstream in(log_path_);
  std::vector<std::string> all;
  std::string line;
  while (std::getline(in, line)) all.push_back(line);
  std::string out;
  for (size_t i = all.size() > lines ? all.size() - lines : 0; i < all.size(); ++i) out += "    | " + all[i] + "\n";
  return out;
}

void StopAllChildren() {
  std::vector<ChildProcess*> all;
  {
    rc::MutexLock lock(g_mu);
    all.assign(g_children.begin(), g_children.end());
  }
  for (auto* c : all) c->Stop(2000);
}

Result<int> FreePort() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return Unavailable("socket() failed");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    close(fd);
    return Unavailable("bind(127.0.0.1:0) failed");
  }
  socklen_t len = sizeof addr;
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  int port = ntohs(addr.sin_port);
  close(fd);
  return port;
}

}  // namespace rc::apps
