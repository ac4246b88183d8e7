// The rolloutcore version string, set by CMake from project(VERSION).
#pragma once

namespace rc {
inline constexpr const char* kVersion = "0.1.0";
}  // namespace rc
