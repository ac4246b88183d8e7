// Helpers of the GPU tests: skipping without a GPU, the CPU reference of a GPU owner's shards
// (same seeded contents, host memory, `local` transport), and the rc_gpu_owner child process.
//
// Thread safety: test-only, single-threaded.
#pragma once

#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <thread>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "rolloutcore/base/json.h"
#include "rolloutcore/cuda/gpu_refit.h"
#include "rolloutcore/cuda/seeded.h"
#include "rolloutcore/refit/digest.h"
#include "rolloutcore/refit/manifest.h"
#include "rolloutcore/transport/local.h"

namespace rc::cuda::testing {

#define RC_SKIP_WITHOUT_GPUS(n)                                                              \
  do {                                                                                       \
    const int rc_gpus_ = ::rc::cuda::DeviceCount();                                          \
    if (rc_gpus_ < (n)) GTEST_SKIP() << "needs " << (n) << " CUDA device(s), found " << rc_gpus_; \
  } while (0)

// Host copies of every shard of `manifest` with the seeded contents, registered with a local
// transport; `manifest()` has local handles and CPU-computed digests.
class HostReference {
 public:
  static std::unique_ptr<HostReference> Make(const refit::Manifest& gpu_manifest, uint64_t seed) {
    auto h = std::unique_ptr<HostReference>(new HostReference());
    h->transport_ = std::move(transport::CreateLocalTransport()).value();
    h->manifest_ = gpu_manifest;
    for (refit::ShardTable& t : h->manifest_.tables) {
      const uint64_t key = SeededTensorKey(seed, t.name);
      const size_t es = refit::DTypeSize(t.dtype);
      const refit::Shape g = refit::RowMajorStrides(t.shape);
      for (refit::ShardInfo& s : t.shards) {
        const int64_t n = refit::NumElements(s.shape);
        auto buf = std::make_unique<std::vector<std::byte>>(static_cast<size_t>(n) * es);
        std::vector<int64_t> idx(s.shape.size(), 0);
        for (int64_t i = 0; i < n; ++i) {
          int64_t rest = i, gi = 0;
          for (size_t d = s.shape.size(); d-- > 0;) {
            gi += (s.offset[d] + rest % s.shape[d]) * g[d];
            rest /= s.shape[d];
          }
          const uint64_t bits = SeededElementBits(static_cast<uint8_t>(t.dtype), key, static_cast<uint64_t>(gi));
          std::memcpy(buf->data() + static_cast<size_t>(i) * es, &bits, es);  // little-endian
        }
        s.digest = refit::DigestBlock(t.dtype, t.shape, s.box(), buf->data());
        s.handle.clear();
        if (!buf->empty()) {
          auto reg = h->transport_->RegisterMemory({buf->data(), buf->size(), transport::MemoryKind::kHost, -1});
          s.handle = reg.value().descriptor;
        }
        h->buffers_.push_back(std::move(buf));
      }
    }
    return h;
  }
  const refit::Manifest& manifest() const { return manifest_; }
  transport::Transport& transport() { return *transport_; }

 private:
  HostReference() = default;
  std::unique_ptr<transport::Transport> transport_;
  refit::Manifest manifest_;
  std::vector<std::unique_ptr<std::vector<std::byte>>> buffers_;
};

// rc_gpu_owner as a child process (see gpu_owner_main.cc): stdout lines are read until READY;
// closing its stdin makes it exit; Kill() SIGKILLs and reaps it.
class OwnerProcess {
 public:
  // The helper binary: $RC_GPU_OWNER_BIN, else rc_gpu_owner next to this test binary (a carried
  // bundle), else the build tree's path.
  static std::string OwnerBinary() {
    if (const char* env = std::getenv("RC_GPU_OWNER_BIN"); env != nullptr && env[0] != '\0') return env;
    char self[4096];
    const ssize_t n = ::readlink("/proc/self/exe", self, sizeof self - 1);
    if (n > 0) {
      self[n] = '\0';
      std::string dir(self);
      dir = dir.substr(0, dir.rfind('/'));
      const std::string next = dir + "/rc_gpu_owner";
      if (::access(next.c_str(), X_OK) == 0) return next;
    }
#ifdef RC_GPU_OWNER_BIN
    return RC_GPU_OWNER_BIN;
#else
    return "rc_gpu_owner";
#endif
  }

  static std::unique_ptr<OwnerProcess> Spawn(const std::vector<std::string>& args, std::string* error) {
    std::vector<std::string> argv_s = {OwnerBinary()};
    argv_s.insert(argv_s.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (auto& a : argv_s) argv.push_back(a.data());
    argv.push_back(nullptr);
    int to_child[2], from_child[2];
    if (::pipe2(to_child, O_CLOEXEC) != 0 || ::pipe2(from_child, O_CLOEXEC) != 0) {
      *error = "pipe failed";
      return nullptr;
    }
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::dup2(to_child[0], 0);
      ::dup2(from_child[1], 1);
      ::execv(argv[0], argv.data());
      ::_exit(127);
    }
    ::close(to_child[0]);
    ::close(from_child[1]);
    auto p = std::unique_ptr<OwnerProcess>(new OwnerProcess(pid, to_child[1], from_child[0]));
    std::string line;
    while (p->ReadLine(&line, 300)) {
      if (line == "READY") return p;
      p->lines_.push_back(line);
    }
    *error = "rc_gpu_owner exited or hung before READY (see its stderr above)";
    return nullptr;
  }
  ~OwnerProcess() {
    if (in_ >= 0) ::close(in_);
    if (!reaped_) {
      for (int i = 0; i < 200 && !Reap(false); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(25));
      if (!reaped_) {
        ::kill(pid_, SIGKILL);
        Reap(true);
      }
    }
    if (out_ >= 0) ::close(out_);
  }
  // Lines printed before READY ("KEY value").
  std::string Value(const std::string& key) const {
    for (const std::string& l : lines_) {
      if (l.rfind(key + " ", 0) == 0) return l.substr(key.size() + 1);
    }
    return "";
  }
  pid_t pid() const { return pid_; }
  void Kill() {
    ::kill(pid_, SIGKILL);
    Reap(true);
  }

 private:
  OwnerProcess(pid_t pid, int in, int out) : pid_(pid), in_(in), out_(out) {}
  bool Reap(bool block) {
    if (reaped_) return true;
    int st = 0;
    if (::waitpid(pid_, &st, block ? 0 : WNOHANG) == pid_) reaped_ = true;
    return reaped_;
  }
  bool ReadLine(std::string* line, int timeout_s) {
    line->clear();
    const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(timeout_s);
    while (std::chrono::steady_clock::now() < end) {
      pollfd pfd{out_, POLLIN, 0};
      if (::poll(&pfd, 1, 100) <= 0) continue;
      char c;
      if (::read(out_, &c, 1) != 1) return false;
      if (c == '\n') return true;
      line->push_back(c);
    }
    return false;
  }
  pid_t pid_;
  int in_, out_;
  bool reaped_ = false;
  std::vector<std::string> lines_;
};

inline refit::Manifest ReadManifest(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return refit::ManifestFromJson(ParseJson(ss.str(), path).value()).value();
}

}  // namespace rc::cuda::testing
