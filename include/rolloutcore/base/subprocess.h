// Subprocess: a child process started with fork + exec, the one helper behind every child that
// rolloutcore starts (the demo's and benchmarks' subcommands, the test helpers' servers and peers).
//
// Spawn prepares everything exec needs (argv, environment, files to redirect to) before fork, so
// the child only calls async-signal-safe functions; it fails with the reason when the executable
// or a file cannot be opened. Options choose, per standard stream, inherit / /dev/null / a pipe
// to this process / a file opened for appending; whether the child leads its own process group
// (signals then go to the whole group); and a parent-death signal (PR_SET_PDEATHSIG), so a child
// never outlives a killed parent.
//
// Exit statuses: Wait/Terminate/Kill return the exit code (>= 0) or minus the terminating signal;
// wait_status() keeps the raw waitpid status for callers that report it as is.
//
// The destructor closes the pipes and SIGKILLs and reaps a child still running, so nothing is
// left behind; a caller that wants a graceful end calls Terminate (or closes stdin and Waits)
// first.
//
// Thread safety: one owner thread per Subprocess.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "rolloutcore/base/status.h"

namespace rc {

enum class ChildIo { kInherit, kNull, kPipe, kFile };

struct SubprocessOptions {
  std::vector<std::string> argv = {};    // argv[0] is the executable's path (no PATH search)
  std::vector<std::string> env = {};     // "NAME=value": added to this process's environment, replacing NAME
  ChildIo stdin_io = ChildIo::kInherit;  // kFile is not supported for stdin
  ChildIo stdout_io = ChildIo::kInherit;
  ChildIo stderr_io = ChildIo::kInherit;
  std::string stdout_path = {};  // kFile: appended to, created 0644
  std::string stderr_path = {};  // kFile; the same path as stdout_path shares one descriptor
  bool own_process_group = false;
  int parent_death_signal = 0;  // 0: none
};

class Subprocess {
 public:
  // Starts the child; the options' argv[0] must be executable.
  [[nodiscard]] static Result<std::unique_ptr<Subprocess>> Spawn(const SubprocessOptions& options);
  // One owner per child (its pid, its pipes): neither copied nor moved.
  Subprocess(const Subprocess&) = delete;
  Subprocess& operator=(const Subprocess&) = delete;
  ~Subprocess();

  // False once the child has exited (it is then reaped; never blocks).
  bool Alive();
  // Waits for the exit: the exit code or -signal. timeout < 0 waits for ever; DeadlineExceeded
  // (the child still running) when it did not exit in time.
  [[nodiscard]] Result<int> Wait(std::chrono::milliseconds timeout);
  // Sends `sig` to the child (and to its group when it leads one); nothing once it is reaped.
  void Signal(int sig);
  // SIGTERM, up to `grace` for the exit, then SIGKILL; the exit code or -signal.
  int Terminate(std::chrono::milliseconds grace);
  // SIGKILL and reap; the exit code or -signal.
  int Kill();
  // SIGKILL, then waits until the kernel reports the child dead without reaping it (a zombie:
  // its pid stays taken, its memory and descriptors are gone). False if that cannot be observed.
  bool KillAndWaitUnreaped();
  // SIGSTOP, then waits (up to timeout) until the kernel reports the child stopped (kill()
  // returns before every thread has stopped). DeadlineExceeded, or FailedPrecondition when the
  // child exited instead. The stop report stays waitable (WNOWAIT). Thaw sends SIGCONT.
  [[nodiscard]] Status Freeze(std::chrono::milliseconds timeout);
  void Thaw();

  // One line of the child's stdout (kPipe), without its newline. DeadlineExceeded when none
  // arrived in time, Unavailable when the child closed its stdout first.
  [[nodiscard]] Result<std::string> ReadLine(std::chrono::milliseconds timeout);
  // Writes all of `data` to the child's stdin (kPipe).
  [[nodiscard]] Status Write(std::string_view data);
  // Closes the child's stdin (a child that reads it sees end of file).
  void CloseStdin();

  pid_t pid() const { return pid_; }
  bool reaped() const { return reaped_; }
  // The raw waitpid status once reaped (0 before).
  int wait_status() const { return wait_status_; }
  // The exit code or -signal of a raw waitpid status.
  static int ExitCodeOf(int wait_status);

 private:
  Subprocess() = default;
  void Reaped(int status);

  pid_t pid_ = -1;
  bool group_ = false;
  bool reaped_ = false;
  int wait_status_ = 0;
  int stdin_fd_ = -1;
  int stdout_fd_ = -1;
  std::string buffer_;  // stdout bytes read past the last line returned
};

}  // namespace rc
