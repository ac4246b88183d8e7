// TrainerProcess: runs `trainer serve` (the rc_trainer_serve_for_test binary) as a child process,
// reads its stdout for the control URL, and signals / reaps it. Shared by the trainer's e2e and
// fault tests.
//
// Thread safety: one owner thread. The destructor SIGKILLs and reaps a child still running, so no
// test leaves a trainer behind.
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "rolloutcore/base/status.h"

#ifndef RC_TRAINER_SERVE_BIN
#error "RC_TRAINER_SERVE_BIN must name the rc_trainer_serve_for_test binary"
#endif

namespace rc::trainer::testing {

class TrainerProcess {
 public:
  // Starts `rc_trainer_serve_for_test trainer serve ARGS... --port 0` and waits (up to 30 s) for
  // its "trainer listening on URL" line.
  static Result<std::unique_ptr<TrainerProcess>> Spawn(const std::vector<std::string>& serve_args) {
    RC_ASSIGN_OR_RETURN(std::unique_ptr<TrainerProcess> p, Start(serve_args));
    const std::string kPrefix = "trainer listening on ";
    for (;;) {
      std::string line;
      if (!p->ReadLine(&line, std::chrono::seconds(30))) {
        return Unavailable("trainer serve exited or hung before listening (see its stderr)");
      }
      p->lines_.push_back(line);
      if (line.rfind(kPrefix, 0) == 0) {
        p->url_ = line.substr(kPrefix.size(), line.find(' ', kPrefix.size()) - kPrefix.size());
        return p;
      }
    }
  }

  // Starts the trainer and waits up to `timeout` for it to exit by itself; its exit status as
  // waitpid reports it (DeadlineExceeded when it is still running, and then it is killed).
  static Result<int> RunUntilExit(const std::vector<std::string>& serve_args, std::chrono::milliseconds timeout) {
    RC_ASSIGN_OR_RETURN(std::unique_ptr<TrainerProcess> p, Start(serve_args));
    const int status = p->SignalAndWait(0, timeout);
    if (status == -1) return DeadlineExceeded("trainer serve did not exit by itself");
    return status;
  }

  TrainerProcess(const TrainerProcess&) = delete;
  TrainerProcess& operator=(const TrainerProcess&) = delete;
  ~TrainerProcess() {
    if (!reaped_) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
    ::close(stdout_fd_);
  }

  pid_t pid() const { return pid_; }
  const std::string& url() const { return url_; }

  // Waits up to `timeout` for a stdout line containing `text`; true when one arrived.
  bool WaitForLine(const std::string& text, std::chrono::milliseconds timeout) {
    for (const std::string& l : lines_) {
      if (l.find(text) != std::string::npos) return true;
    }
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < deadline) {
      std::string line;
      if (!ReadLine(&line, std::chrono::duration_cast<std::chrono::milliseconds>(
                               deadline - std::chrono::steady_clock::now()))) {
        return false;
      }
      lines_.push_back(line);
      if (line.find(text) != std::string::npos) return true;
    }
    return false;
  }

  // Sends `sig` and waits up to `timeout` for the exit; the exit status (as waitpid reports it),
  // or -1 when it did not exit in time.
  int SignalAndWait(int sig, std::chrono::milliseconds timeout) {
    ::kill(pid_, sig);
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < deadline) {
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        reaped_ = true;
        return status;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return -1;
  }

 private:
  static Result<std::unique_ptr<TrainerProcess>> Start(const std::vector<std::string>& serve_args) {
    std::vector<std::string> args = {RC_TRAINER_SERVE_BIN, "trainer", "serve", "--port", "0"};
    args.insert(args.end(), serve_args.begin(), serve_args.end());
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    int out[2];
    if (::pipe2(out, O_CLOEXEC) != 0) return Internal(std::string("pipe: ") + std::strerror(errno));
    const pid_t pid = ::fork();
    if (pid < 0) return Internal(std::string("fork: ") + std::strerror(errno));
    if (pid == 0) {
      ::dup2(out[1], 1);
      ::execv(argv[0], argv.data());
      ::_exit(127);
    }
    ::close(out[1]);
    return std::unique_ptr<TrainerProcess>(new TrainerProcess(pid, out[0]));
  }

  TrainerProcess(pid_t pid, int stdout_fd) : pid_(pid), stdout_fd_(stdout_fd) {}

  bool ReadLine(std::string* line, std::chrono::milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      const size_t nl = buffer_.find('\n');
      if (nl != std::string::npos) {
        *line = buffer_.substr(0, nl);
        buffer_.erase(0, nl + 1);
        return true;
      }
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) return false;
      pollfd pfd{stdout_fd_, POLLIN, 0};
      if (::poll(&pfd, 1, static_cast<int>(left.count())) <= 0) continue;
      char chunk[4096];
      const ssize_t n = ::read(stdout_fd_, chunk, sizeof chunk);
      if (n <= 0) return false;
      buffer_.append(chunk, static_cast<size_t>(n));
    }
  }

  pid_t pid_;
  int stdout_fd_;
  bool reaped_ = false;
  std::string url_;
  std::string buffer_;
  std::vector<std::string> lines_;
};

}  // namespace rc::trainer::testing
