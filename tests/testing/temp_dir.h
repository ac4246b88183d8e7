// TempDir: a folder of the test's own under the temp root ($TMPDIR, as ::testing::TempDir() says),
// made unique with mkdtemp and removed with its contents when the object goes. Tests that write
// model folders or safetensors files use it, so ctest -j runs of the same binary never share a
// folder and a run leaves nothing behind.
#pragma once

#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <string>
#include <system_error>
#include <vector>

namespace rc::testing {

class TempDir {
 public:
  // `prefix` names the folder ("<prefix>XXXXXX"); it should say which test made it.
  explicit TempDir(const std::string& prefix) {
    std::string root = ::testing::TempDir();
    if (!root.empty() && root.back() != '/') root += '/';
    std::vector<char> templ(root.begin(), root.end());
    templ.insert(templ.end(), prefix.begin(), prefix.end());
    for (const char c : std::string("XXXXXX")) templ.push_back(c);
    templ.push_back('\0');
    if (::mkdtemp(templ.data()) == nullptr) {
      ADD_FAILURE() << "mkdtemp under " << root << " failed";
      return;
    }
    path_ = templ.data();
  }
  ~TempDir() {
    std::error_code ec;  // best effort: a test that failed may have left a file open
    if (!path_.empty()) std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::string& path() const { return path_; }
  // path() + "/" + name.
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

}  // namespace rc::testing
