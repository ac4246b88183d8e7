// StopSignals: how every long-running subcommand (the `serve` commands, the demo, the GPU owner)
// waits for Ctrl-C or SIGTERM.
//
// Constructing one blocks SIGINT and SIGTERM in the calling thread. Construct it before any thread
// starts: every thread then inherits the mask, no thread runs a handler (stopping a server from a
// handler is not safe), and the one thread that calls Wait() receives the signal through sigwait.
//
// Thread safety: construct on the main thread before starting others; Wait from one thread.
#pragma once

#include <pthread.h>
#include <signal.h>

namespace rc::apps {

class StopSignals {
 public:
  StopSignals() {
    sigemptyset(&set_);
    sigaddset(&set_, SIGINT);
    sigaddset(&set_, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &set_, nullptr);
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
