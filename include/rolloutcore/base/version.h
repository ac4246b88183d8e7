// The rolloutcore version string. CMake sets it from project(VERSION) in the top-level
// CMakeLists.txt: src/base/version.cc is the one file compiled with ROLLOUTCORE_VERSION (see
// src/base/CMakeLists.txt), so a version bump rebuilds one file, and no header repeats the number.
// The Python package's version (pyproject.toml, python/rolloutcore/__init__.py) is written
// separately.
//
// Thread safety: a constant.
#pragma once

namespace rc {
extern const char* const kVersion;  // "MAJOR.MINOR.PATCH"
}  // namespace rc
