#include "transport/common/process.h"

#include <signal.h>

#include <cerrno>
#include <cstdio>
#include <string_view>

namespace rc::transport::internal {

bool ProcessGone(pid_t pid) {
  if (pid <= 0) return false;
  if (::kill(pid, 0) != 0 && errno == ESRCH) return true;
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%d/stat", static_cast<int>(pid));
  FILE* f = std::fopen(path, "r");
  if (f == nullptr) return errno == ENOENT;
  char buf[512] = {};
  const size_t n = std::fread(buf, 1, sizeof buf - 1, f);
  std::fclose(f);
  const std::string_view stat(buf, n);
  const size_t paren = stat.rfind(')');  // the command name may contain spaces and parens
  if (paren == std::string_view::npos || paren + 2 >= stat.size()) return false;
  const char state = stat[paren + 2];
  return state == 'Z' || state == 'X';
}

}  // namespace rc::transport::internal
