// StopSignals: how every long-running subcommand (the `serve` commands, the demo, the GPU owner)
// waits for Ctrl-C or SIGTERM.
//
// Constructing one blocks SIGINT and SIGTERM in the calling thread. Construct it before any thread
// starts: every thread then inherits the mask, no thread runs a handler (stopping a server from a
// handler is not safe), and the one thread that calls Wait() receives the signal through sigwait.
//
// Thread safety: construct on the main thread before starting others; Wait from one thread.
//
// StopWithParentFromEnv: with ROLLOUTCORE_EXIT_WITH_PARENT=PID in the environment (what
// rolloutcore.LocalCluster sets for the servers it starts), the process stops as on SIGTERM once
// its parent is no longer PID: the parent died, even by SIGKILL, and the process was re-parented.
// A detached thread checks getppid() every 200 ms (unlike PR_SET_PDEATHSIG, this does not fire
// when the parent's thread that started the process ends while the parent lives on). A value that
// is not a process id is reported on stderr and ignored. StopSignals' constructor calls it; a
// command that stops on its own signal handler calls it after installing the handler.
#pragma once

#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <iostream>
#include <mutex>
#include <thread>

namespace rc::apps {

inline constexpr const char* kExitWithParentEnv = "ROLLOUTCORE_EXIT_WITH_PARENT";

inline void StopWithParentFromEnv() {
  static std::once_flag once;
  std::call_once(once, [] {
    const char* v = std::getenv(kExitWithParentEnv);
    if (v == nullptr || *v == '\0') return;
    char* end = nullptr;
    errno = 0;
    const long pid = std::strtol(v, &end, 10);
    if (errno != 0 || *end != '\0' || pid <= 1) {
      std::cerr << kExitWithParentEnv << "='" << v << "' is not the process id of a parent: ignored\n";
      return;
    }
    std::thread([pid] {
      while (getppid() == static_cast<pid_t>(pid)) std::this_thread::sleep_for(std::chrono::milliseconds(200));
      std::cerr << "parent process " << pid << " is gone (" << kExitWithParentEnv << "): stopping" << std::endl;
      kill(getpid(), SIGTERM);
    }).detach();
  });
}

class StopSignals {
 public:
  StopSignals() {
    sigemptyset(&set_);
    sigaddset(&set_, SIGINT);
    sigaddset(&set_, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &set_, nullptr);
    StopWithParentFromEnv();  // its thread inherits the mask
  }
  // Blocks until SIGINT or SIGTERM arrives; its number.
  int Wait() const {
    int sig = 0;
    sigwait(&set_, &sig);
    return sig;
  }

 private:
  sigset_t set_;
};

}  // namespace rc::apps
