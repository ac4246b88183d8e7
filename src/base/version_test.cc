#include "rolloutcore/base/version.h"

#include <gtest/gtest.h>

namespace rc {
namespace {

// RC_PROJECT_VERSION is ${PROJECT_VERSION}, passed to this test by src/base/CMakeLists.txt: the
// version the binaries report is the one project(VERSION) declares, not a copy of it.
TEST(VersionTest, IsTheCMakeProjectVersion) { EXPECT_STREQ(kVersion, RC_PROJECT_VERSION); }

}  // namespace
}  // namespace rc
