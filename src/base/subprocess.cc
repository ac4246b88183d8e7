#include "rolloutcore/base/subprocess.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <thread>

extern char** environ;

namespace rc {
namespace {

std::string Errno() { return std::strerror(errno); }

void CloseFd(int& fd) {
  if (fd >= 0) ::close(fd);
  fd = -1;
}

// The file descriptors the child gets as stdin/stdout/stderr, opened before fork.
struct ChildFds {
  int in[2] = {-1, -1};   // pipe to the child's stdin
  int out[2] = {-1, -1};  // pipe from the child's stdout
  int child_in = -1, child_out = -1, child_err = -1;  // what the child dup2s (-1: inherit)
  std::vector<int> to_close;  // everything the parent opened, closed after fork

  ~ChildFds() {
    for (int fd : to_close) ::close(fd);
  }
  int Keep(int fd) {
    if (fd >= 0) to_close.push_back(fd);
    return fd;
  }
};

Result<int> OpenFor(ChildIo io, const std::string& path, bool write, const char* stream, ChildFds* fds) {
  switch (io) {
    case ChildIo::kInherit: return -1;
    case ChildIo::kNull: {
      const int fd = fds->Keep(::open("/dev/null", (write ? O_WRONLY : O_RDONLY) | O_CLOEXEC));
      if (fd < 0) return Unavailable(fmt::format("cannot open /dev/null for the child's {}: {}", stream, Errno()));
      return fd;
    }
    case ChildIo::kFile: {
      if (!write) return InvalidArgument("a child's stdin cannot be a file (use kPipe or kNull)");
      const int fd = fds->Keep(::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644));
      if (fd < 0) return Unavailable(fmt::format("cannot open '{}' for the child's {}: {}", path, stream, Errno()));
      return fd;
    }
    case ChildIo::kPipe: return -2;  // set up by the caller
  }
  return -1;
}

std::vector<std::string> MergedEnvironment(const std::vector<std::string>& extra) {
  std::vector<std::string> out;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string_view kv = *e;
    bool replaced = false;
    for (const std::string& o : extra) replaced |= kv.substr(0, kv.find('=')) == o.substr(0, o.find('='));
    if (!replaced) out.emplace_back(kv);
  }
  out.insert(out.end(), extra.begin(), extra.end());
  return out;
}

}  // namespace

int Subprocess::ExitCodeOf(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return -WTERMSIG(status);
  return status;
}

Result<std::unique_ptr<Subprocess>> Subprocess::Spawn(const SubprocessOptions& o) {
  if (o.argv.empty() || o.argv[0].empty()) return InvalidArgument("subprocess: argv[0] (the executable) is empty");
  if (::access(o.argv[0].c_str(), X_OK) != 0) {
    return Unavailable(fmt::format("subprocess: cannot execute '{}': {}", o.argv[0], Errno()));
  }
  ChildFds fds;
  RC_ASSIGN_OR_RETURN(fds.child_in, OpenFor(o.stdin_io, "", false, "stdin", &fds));
  RC_ASSIGN_OR_RETURN(fds.child_out, OpenFor(o.stdout_io, o.stdout_path, true, "stdout", &fds));
  if (o.stderr_io == ChildIo::kFile && o.stdout_io == ChildIo::kFile && o.stderr_path == o.stdout_path) {
    fds.child_err = fds.child_out;
  } else {
    RC_ASSIGN_OR_RETURN(fds.child_err, OpenFor(o.stderr_io, o.stderr_path, true, "stderr", &fds));
  }
  if (o.stderr_io == ChildIo::kPipe) return InvalidArgument("subprocess: stderr cannot be a pipe (use a file)");
  if (o.stdin_io == ChildIo::kPipe) {
    if (::pipe2(fds.in, O_CLOEXEC) != 0) return Internal("subprocess: pipe: " + Errno());
    fds.child_in = fds.Keep(fds.in[0]);
  }
  if (o.stdout_io == ChildIo::kPipe) {
    if (::pipe2(fds.out, O_CLOEXEC) != 0) {
      if (fds.in[1] >= 0) ::close(fds.in[1]);
      return Internal("subprocess: pipe: " + Errno());
    }
    fds.child_out = fds.Keep(fds.out[1]);
  }
  // Everything exec needs, built before fork.
  std::vector<std::string> args = o.argv;
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  std::vector<std::string> envs;
  std::vector<char*> envp;
  if (!o.env.empty()) {
    envs = MergedEnvironment(o.env);
    for (auto& e : envs) envp.push_back(e.data());
    envp.push_back(nullptr);
  }
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) {
    CloseFd(fds.in[1]);
    CloseFd(fds.out[0]);
    return Unavailable(fmt::format("subprocess: fork for '{}' failed: {}", o.argv[0], Errno()));
  }
  if (pid == 0) {
    if (o.own_process_group) ::setpgid(0, 0);
    if (o.parent_death_signal != 0) {
      ::prctl(PR_SET_PDEATHSIG, o.parent_death_signal);
      if (::getppid() != parent) ::_exit(127);  // the parent died before prctl
    }
    // dup2 clears O_CLOEXEC on the new descriptor; the originals close at exec.
    if (fds.child_in >= 0) ::dup2(fds.child_in, STDIN_FILENO);
    if (fds.child_out >= 0) ::dup2(fds.child_out, STDOUT_FILENO);
    if (fds.child_err >= 0) ::dup2(fds.child_err, STDERR_FILENO);
    if (envp.empty()) {
      ::execv(argv[0], argv.data());
    } else {
      ::execve(argv[0], argv.data(), envp.data());
    }
    ::_exit(127);
  }
  if (o.own_process_group) ::setpgid(pid, pid);  // either side may win the race; both set it
  auto p = std::unique_ptr<Subprocess>(new Subprocess());
  p->pid_ = pid;
  p->group_ = o.own_process_group;
  p->stdin_fd_ = fds.in[1];
  p->stdout_fd_ = fds.out[0];
  return p;
}

Subprocess::~Subprocess() {
  CloseFd(stdin_fd_);
  if (!reaped_) Kill();
  CloseFd(stdout_fd_);
}

void Subprocess::Reaped(int status) {
  reaped_ = true;
  wait_status_ = status;
}

bool Subprocess::Alive() {
  if (reaped_) return false;
  int st = 0;
  if (::waitpid(pid_, &st, WNOHANG) == pid_) {
    Reaped(st);
    return false;
  }
  return true;
}

Result<int> Subprocess::Wait(std::chrono::milliseconds timeout) {
  if (!reaped_ && timeout.count() < 0) {
    int st = 0;
    pid_t r;
    while ((r = ::waitpid(pid_, &st, 0)) < 0 && errno == EINTR) {
    }
    if (r == pid_) Reaped(st);
  }
  const auto deadline = std::chrono::steady_clock::now() + (timeout.count() < 0 ? std::chrono::milliseconds(0) : timeout);
  while (Alive()) {
    if (std::chrono::steady_clock::now() >= deadline) {
      return DeadlineExceeded(fmt::format("child {} did not exit within {} ms", pid_, timeout.count()));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return ExitCodeOf(wait_status_);
}

void Subprocess::Signal(int sig) {
  if (reaped_) return;
  if (group_) ::kill(-pid_, sig);
  ::kill(pid_, sig);
}

int Subprocess::Terminate(std::chrono::milliseconds grace) {
  if (reaped_) return ExitCodeOf(wait_status_);
  Signal(SIGTERM);
  auto code = Wait(grace);
  if (code.ok()) return *code;
  return Kill();
}

int Subprocess::Kill() {
  if (!reaped_) {
    Signal(SIGKILL);
    (void)Wait(std::chrono::milliseconds(-1));
  }
  return ExitCodeOf(wait_status_);
}

bool Subprocess::KillAndWaitUnreaped() {
  if (reaped_) return false;
  Signal(SIGKILL);
  for (;;) {
    siginfo_t info{};
    if (::waitid(P_PID, static_cast<id_t>(pid_), &info, WEXITED | WNOWAIT) == 0) return true;
    if (errno != EINTR) return false;
  }
}

Status Subprocess::Freeze(std::chrono::milliseconds timeout) {
  if (reaped_) return FailedPrecondition(fmt::format("child {} is not running", pid_));
  Signal(SIGSTOP);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (true) {
    siginfo_t info{};
    if (::waitid(P_PID, static_cast<id_t>(pid_), &info, WSTOPPED | WEXITED | WNOWAIT | WNOHANG) == 0 &&
        info.si_pid == pid_) {
      if (info.si_code == CLD_STOPPED || info.si_code == CLD_TRAPPED) return OkStatus();
      return FailedPrecondition(fmt::format("child {} exited instead of stopping", pid_));
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      return DeadlineExceeded(
          fmt::format("child {} was not reported stopped within {} ms", pid_, timeout.count()));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

void Subprocess::Thaw() { Signal(SIGCONT); }

Result<std::string> Subprocess::ReadLine(std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    const size_t nl = buffer_.find('\n');
    if (nl != std::string::npos) {
      std::string line = buffer_.substr(0, nl);
      buffer_.erase(0, nl + 1);
      return line;
    }
    if (stdout_fd_ < 0) return FailedPrecondition(fmt::format("child {}: stdout is not a pipe", pid_));
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      return DeadlineExceeded(fmt::format("child {} printed no line within {} ms", pid_, timeout.count()));
    }
    pollfd p{stdout_fd_, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) continue;
    char chunk[65536];
    const ssize_t n = ::read(stdout_fd_, chunk, sizeof chunk);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return Unavailable(fmt::format("child {} closed its stdout", pid_));
    buffer_.append(chunk, static_cast<size_t>(n));
  }
}

Status Subprocess::Write(std::string_view data) {
  if (stdin_fd_ < 0) return FailedPrecondition(fmt::format("child {}: stdin is not an open pipe", pid_));
  while (!data.empty()) {
    const ssize_t n = ::write(stdin_fd_, data.data(), data.size());
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return Unavailable(fmt::format("child {}: write to stdin failed: {}", pid_, Errno()));
    data.remove_prefix(static_cast<size_t>(n));
  }
  return OkStatus();
}

void Subprocess::CloseStdin() { CloseFd(stdin_fd_); }

}  // namespace rc
