// PeerProcess: runs rc_transport_peer (see transport_peer_main.cc) as a child process and talks to
// it over pipes (an rc::Subprocess): its descriptors, commands, signals. Used by the cross-process tests and the
// benchmark.
//
// Thread safety: one owner thread. The destructor closes the child's stdin (it exits on EOF),
// waits up to 5 s, then SIGKILLs and reaps it, so no test leaves a child behind.
#pragma once

#include <signal.h>  // the signals callers send

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "rolloutcore/base/status.h"
#include "rolloutcore/base/subprocess.h"

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
    SubprocessOptions o;
    o.argv = {RC_TRANSPORT_PEER_BIN, backend, std::to_string(seed)};
    for (uint64_t s : sizes) o.argv.push_back(std::to_string(s));
    o.env = env;
    o.stdin_io = o.stdout_io = ChildIo::kPipe;
    RC_ASSIGN_OR_RETURN(std::unique_ptr<Subprocess> proc, Subprocess::Spawn(o));
    auto p = std::unique_ptr<PeerProcess>(new PeerProcess(std::move(proc)));
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
    proc_->CloseStdin();
    proc_->Thaw();
    // The Subprocess destructor SIGKILLs and reaps it when it did not exit in 5 s.
    (void)proc_->Wait(std::chrono::seconds(5));
  }

  pid_t pid() const { return proc_->pid(); }
  const std::vector<std::string>& descriptors() const { return descriptors_; }

  // Sends a command line and returns the child's one-line answer ("" if none within 10 s).
  std::string Command(const std::string& command) {
    if (!proc_->Write(command + "\n").ok()) return "";
    std::string answer;
    ReadLine(&answer, std::chrono::seconds(10));
    return answer;
  }

  void Signal(int sig) { proc_->Signal(sig); }

  // SIGSTOP, then waits until the kernel reports the child stopped (every thread of it): kill()
  // alone returns before the child stops, and on a busy machine it may still run, and answer
  // requests, for a while after. False when the child exited instead.
  bool Stop() { return proc_->Freeze(std::chrono::minutes(10)).ok(); }

  // SIGKILL, then waits until the child is dead but not reaped (a zombie: its pid exists, its
  // memory and file descriptors are gone).
  bool KillAndWaitUnreaped() { return proc_->KillAndWaitUnreaped(); }

  // SIGKILL and reap: afterwards the pid no longer exists.
  void KillAndReap() { proc_->Kill(); }

 private:
  explicit PeerProcess(std::unique_ptr<Subprocess> proc) : proc_(std::move(proc)) {}

  bool ReadLine(std::string* line, std::chrono::milliseconds timeout) {
    auto l = proc_->ReadLine(timeout);
    if (!l.ok()) return false;
    *line = std::move(l).value();
    return true;
  }

  std::unique_ptr<Subprocess> proc_;
  std::vector<std::string> descriptors_;
};

}  // namespace rc::transport::testing
