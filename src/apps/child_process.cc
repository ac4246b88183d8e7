#include "apps/child_process.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <fstream>
#include <mutex>
#include <set>
#include <thread>

#include "rolloutcore/base/mutex.h"

namespace rc::apps {
namespace {

rc::Mutex g_mu;
std::set<ChildProcess*> g_children GUARDED_BY(g_mu);  // guarded by g_mu

}  // namespace

Result<std::unique_ptr<ChildProcess>> ChildProcess::Spawn(const std::string& name,
                                                          const std::vector<std::string>& args,
                                                          const std::string& log_path, const std::string& exe_path) {
  char exe[4096];
  if (exe_path.empty()) {
    ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
    if (n <= 0) return Internal("cannot find my own executable (/proc/self/exe)");
    exe[n] = '\0';
  } else {
    if (exe_path.size() >= sizeof(exe)) return InvalidArgument("executable path too long");
    std::memcpy(exe, exe_path.c_str(), exe_path.size() + 1);
  }
  int log_fd = open(log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (log_fd < 0) return Unavailable("cannot open log '" + log_path + "'");
  std::vector<std::string> argv_s = {exe};
  argv_s.insert(argv_s.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : argv_s) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t parent = getpid();
  pid_t pid = fork();
  if (pid < 0) {
    close(log_fd);
    return Unavailable("fork failed for " + name);
  }
  if (pid == 0) {
    setpgid(0, 0);
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (getppid() != parent) _exit(127);  // the parent died before prctl
    dup2(log_fd, 1);
    dup2(log_fd, 2);
    int devnull = open("/dev/null", O_RDONLY);
    if (devnull >= 0) dup2(devnull, 0);
    execv(exe, argv.data());
    _exit(127);
  }
  close(log_fd);
  setpgid(pid, pid);
  auto c = std::make_unique<ChildProcess>();
  c->name_ = name;
  c->log_path_ = log_path;
  c->pid_ = pid;
  rc::MutexLock lock(g_mu);
  g_children.insert(c.get());
  return c;
}

ChildProcess::~ChildProcess() {
  Stop();
  rc::MutexLock lock(g_mu);
  g_children.erase(this);
}

bool ChildProcess::Alive() {
  if (pid_ <= 0 || reaped_) return false;
  int st = 0;
  pid_t r = waitpid(pid_, &st, WNOHANG);
  if (r == pid_) {
    reaped_ = true;
    status_ = WIFEXITED(st) ? WEXITSTATUS(st) : -WTERMSIG(st);
    return false;
  }
  return true;
}

int ChildProcess::Stop(int grace_ms) {
  if (pid_ <= 0 || reaped_) return status_;
  kill(-pid_, SIGTERM);
  kill(pid_, SIGTERM);
  auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(grace_ms);
  while (std::chrono::steady_clock::now() < deadline) {
    if (!Alive()) return status_;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  Kill();
  return status_;
}

void ChildProcess::Kill() {
  if (pid_ <= 0 || reaped_) return;
  kill(-pid_, SIGKILL);
  kill(pid_, SIGKILL);
  int st = 0;
  if (waitpid(pid_, &st, 0) == pid_) {
    reaped_ = true;
    status_ = WIFEXITED(st) ? WEXITSTATUS(st) : -WTERMSIG(st);
  }
}

Status ChildProcess::Freeze(int timeout_ms) {
  if (pid_ <= 0 || reaped_) return FailedPrecondition(name_ + " is not running");
  kill(-pid_, SIGSTOP);
  kill(pid_, SIGSTOP);
  auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (true) {
    siginfo_t info{};
    if (waitid(P_PID, static_cast<id_t>(pid_), &info, WSTOPPED | WEXITED | WNOWAIT | WNOHANG) == 0 &&
        info.si_pid == pid_) {
      if (info.si_code == CLD_STOPPED || info.si_code == CLD_TRAPPED) return OkStatus();
      return FailedPrecondition(name_ + " exited instead of stopping");
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      return DeadlineExceeded(name_ + " was not reported stopped within " + std::to_string(timeout_ms) + " ms");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

void ChildProcess::Thaw() {
  if (pid_ <= 0 || reaped_) return;
  kill(-pid_, SIGCONT);
  kill(pid_, SIGCONT);
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
