#include "rolloutcore/base/version.h"

#ifndef ROLLOUTCORE_VERSION
#error "ROLLOUTCORE_VERSION is set by src/base/CMakeLists.txt from project(VERSION)"
#endif

namespace rc {
const char* const kVersion = ROLLOUTCORE_VERSION;
}  // namespace rc
