// TrainerProcess: runs `trainer serve` (the rc_trainer_serve_for_test binary) as a child process,
// reads its stdout for the control URL, and signals / reaps it (an rc::Subprocess). Shared by the trainer's e2e and
// fault tests.
//
// Thread safety: one owner thread. The destructor SIGKILLs and reaps a child still running, so no
// test leaves a trainer behind.
#pragma once

#include <signal.h>    // the signals callers send
#include <sys/wait.h>  // WIFEXITED & co. for the statuses returned

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "rolloutcore/base/status.h"
#include "rolloutcore/base/subprocess.h"

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

  pid_t pid() const { return proc_->pid(); }
  const std::string& url() const { return url_; }

  // Waits up to `timeout` for a stdout line containing `text`; true when one arrived.
  bool WaitForLine(const std::string& text, std::chrono::milliseconds timeout) {
    for (const std::string& l : lines_) {
      if (l.find(text) != std::string::npos) return true;
    }
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < deadline) {
      auto line = proc_->ReadLine(
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()));
      if (!line.ok()) return false;
      lines_.push_back(*line);
      if (line->find(text) != std::string::npos) return true;
    }
    return false;
  }

  // Sends `sig` and waits up to `timeout` for the exit; the exit status (as waitpid reports it),
  // or -1 when it did not exit in time.
  int SignalAndWait(int sig, std::chrono::milliseconds timeout) {
    if (sig != 0) proc_->Signal(sig);
    if (!proc_->Wait(timeout).ok()) return -1;
    return proc_->wait_status();
  }

 private:
  static Result<std::unique_ptr<TrainerProcess>> Start(const std::vector<std::string>& serve_args) {
    SubprocessOptions o;
    o.argv = {RC_TRAINER_SERVE_BIN, "trainer", "serve", "--port", "0"};
    o.argv.insert(o.argv.end(), serve_args.begin(), serve_args.end());
    o.stdout_io = ChildIo::kPipe;
    RC_ASSIGN_OR_RETURN(std::unique_ptr<Subprocess> proc, Subprocess::Spawn(o));
    return std::unique_ptr<TrainerProcess>(new TrainerProcess(std::move(proc)));
  }

  explicit TrainerProcess(std::unique_ptr<Subprocess> proc) : proc_(std::move(proc)) {}

  bool ReadLine(std::string* line, std::chrono::milliseconds timeout) {
    auto l = proc_->ReadLine(timeout);
    if (!l.ok()) return false;
    *line = std::move(l).value();
    return true;
  }

  std::unique_ptr<Subprocess> proc_;  // SIGKILLed and reaped on destruction when still running
  std::string url_;
  std::vector<std::string> lines_;
};

}  // namespace rc::trainer::testing
