// ScopedEnv: sets an environment variable (UCX_TLS, ...) for one test and restores it after.
// UCX reads its configuration when a transport is created, so set it before CreateUcxTransport.
// Not thread-safe (setenv); use from the test's main thread before starting transports.
#pragma once

#include <cstdlib>
#include <optional>
#include <string>

namespace rc::transport::testing {

class ScopedEnv {
 public:
  ScopedEnv(std::string name, const std::string& value) : name_(std::move(name)) {
    if (const char* old = std::getenv(name_.c_str())) old_ = old;
    ::setenv(name_.c_str(), value.c_str(), 1);
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;
  ~ScopedEnv() {
    if (old_) ::setenv(name_.c_str(), old_->c_str(), 1);
    else ::unsetenv(name_.c_str());
  }

 private:
  std::string name_;
  std::optional<std::string> old_;
};

}  // namespace rc::transport::testing
