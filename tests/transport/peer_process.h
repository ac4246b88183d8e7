// PeerProcess: runs rc_transport_peer (see transport_peer_main.cc) as a child process and talks to
// it over pipes: its descriptors, commands, signals. Used by the cross-process tests and the
// benchmark.
//
// Thread safety: one owner thread. The destructor closes the child's stdin (it exits on EOF),
// waits up to 5 s, then SIGKILLs and reaps it, so no test leaves a child behind.
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "rolloutcore/base/status.h"

extern char** environ;

namespace rc::transport::testing {

#ifndef RC_TRANSPORT_PEER_BIN
#error "RC_TRANSPORT_PEER_BIN must name the rc_transport_peer binary"
#endif

class PeerProcess {
 public:
  // Starts `rc_transport_peer backend seed sizes...` with the current environment plus `env`
  // ("NAME=value") and waits (up to 30 s) for its descriptors.
  static Result<std::unique_ptr<PeerProcess>> Spawn(const std::string& backend, uint64_t seed,
                                                    const std::vector<uint64_t>& sizes,
                                                    const std::vector<std::string>& env = {}) {
    std::vector<std::string> args = {RC_TRANSPORT_PEER_BIN, backend, std::to_string(seed)};
    for (uint64_t s : sizes) args.push_back(std::to_string(s));
    std::vector<std::string> envs;
    for (char** e = environ; *e != nullptr; ++e) {
      const std::string kv = *e;
      bool overridden = false;
      for (const std::string& o : env) overridden |= kv.substr(0, kv.find('=')) == o.substr(0, o.find('='));
      if (!overridden) envs.push_back(kv);
    }
    for (const std::string& o : env) envs.push_back(o);
    // Everything exec needs is built before fork: the child only calls async-signal-safe functions.
    std::vector<char*> argv, envp;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    for (auto& e : envs) envp.push_back(e.data());
    envp.push_back(nullptr);

    int to_child[2], from_child[2];
    if (::pipe2(to_child, O_CLOEXEC) != 0 || ::pipe2(from_child, O_CLOEXEC) != 0) {
      return Internal(std::string("pipe: ") + std::strerror(errno));
    }
    const pid_t pid = ::fork();
    if (pid < 0) return Internal(std::string("fork: ") + std::strerror(errno));
    if (pid == 0) {
      ::dup2(to_child[0], 0);
      ::dup2(from_child[1], 1);
      ::execve(argv[0], argv.data(), envp.data());
      ::_exit(127);
    }
    ::close(to_child[0]);
    ::close(from_child[1]);
    auto p = std::unique_ptr<PeerProcess>(new PeerProcess(pid, to_child[1], from_child[0]));
    for (;;) {
      std::string line;
      if (!p->ReadLine(&line, std::chrono::seconds(30))) {
        return Unavailable("rc_transport_peer " + backend + " exited or hung before READY (see its stderr)");
      }
      if (line == "READY") break;
      if (line.rfind("DESC ", 0) == 0) {
        const size_t sp = line.find(' ', 5);
        p->descriptors_.push_back(line.substr(sp + 1));
      }
    }
    return p;
  }

  PeerProcess(const PeerProcess&) = delete;
  PeerProcess& operator=(const PeerProcess&) = delete;
  ~PeerProcess() {
    if (stdin_fd_ >= 0) ::close(stdin_fd_);
    if (pid_ > 0) {
      ::kill(pid_, SIGCONT);
      const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(5);
      while (!reaped_ && std::chrono::steady_clock::now() < give_up) {
        if (::waitpid(pid_, nullptr, WNOHANG) == pid_) reaped_ = true;
        else std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
      if (!reaped_) {
        ::kill(pid_, SIGKILL);
        ::waitpid(pid_, nullptr, 0);
      }
    }
    if (stdout_fd_ >= 0) ::close(stdout_fd_);
  }

  pid_t pid() const { return pid_; }
  const std::vector<std::string>& descriptors() const { return descriptors_; }

  // Sends a command line and returns the child's one-line answer ("" if none within 10 s).
  std::string Command(const std::string& command) {
    const std::string line = command + "\n";
    if (::write(stdin_fd_, line.data(), line.size()) != static_cast<ssize_t>(line.size())) return "";
    std::string answer;
    ReadLine(&answer, std::chrono::seconds(10));
    return answer;
  }

  void Signal(int sig) { ::kill(pid_, sig); }

  // SIGSTOP, then waits until the kernel reports the child stopped (waitpid with WUNTRACED, which
  // answers only once every thread of the child has stopped). kill() alone returns before the
  // child stops: on a busy machine it may still run, and answer requests, for a while after.
  // False when the child exited instead (it is then reaped).
  bool Stop() {
    if (::kill(pid_, SIGSTOP) != 0) return false;
    for (;;) {
      int status = 0;
      const pid_t r = ::waitpid(pid_, &status, WUNTRACED);
      if (r == pid_ && WIFSTOPPED(status)) return true;
      if (r == pid_) {
        reaped_ = true;
        return false;
      }
      if (r < 0 && errno != EINTR) return false;
    }
  }

  // SIGKILL, then waits until the child is dead but not reaped (a zombie: its pid exists, its
  // memory and file descriptors are gone). waitid with WNOWAIT observes the exit without reaping.
  bool KillAndWaitUnreaped() {
    ::kill(pid_, SIGKILL);
    for (;;) {
      siginfo_t info{};
      if (::waitid(P_PID, static_cast<id_t>(pid_), &info, WEXITED | WNOWAIT) == 0) return true;
      if (errno != EINTR) return false;
    }
  }

  // SIGKILL and reap: afterwards the pid no longer exists.
  void KillAndReap() {
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
    reaped_ = true;
  }

 private:
  PeerProcess(pid_t pid, int stdin_fd, int stdout_fd) : pid_(pid), stdin_fd_(stdin_fd), stdout_fd_(stdout_fd) {}

  bool ReadLine(std::string* line, std::chrono::milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      const size_t nl = buffer_.find('\n');
      if (nl != std::string::npos) {
        *line = buffer_.substr(0, nl);
        buffer_.erase(0, nl + 1);
        return true;
      }
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) return false;
      pollfd pfd{stdout_fd_, POLLIN, 0};
      if (::poll(&pfd, 1, static_cast<int>(left.count())) <= 0) continue;
      char chunk[65536];
      const ssize_t n = ::read(stdout_fd_, chunk, sizeof chunk);
      if (n <= 0) return false;
      buffer_.append(chunk, static_cast<size_t>(n));
    }
  }

  pid_t pid_;
  int stdin_fd_;
  int stdout_fd_;
  bool reaped_ = false;
  std::string buffer_;
  std::vector<std::string> descriptors_;
};

}  // namespace rc::transport::testing
