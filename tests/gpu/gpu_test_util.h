// Helpers of the GPU tests: skipping without a GPU, the CPU reference of a GPU owner's shards
// (same seeded contents, host memory, `local` transport), and the rc_gpu_owner child process.
//
// Thread safety: test-only, single-threaded.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "rolloutcore/base/json.h"
#include "rolloutcore/base/subprocess.h"
#include "rolloutcore/refit/capture.h"
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
// closing its stdin makes it exit; Kill() SIGKILLs and reaps it (an rc::Subprocess).
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
    SubprocessOptions o;
    o.argv = {OwnerBinary()};
    o.argv.insert(o.argv.end(), args.begin(), args.end());
    o.stdin_io = o.stdout_io = ChildIo::kPipe;
    auto proc = Subprocess::Spawn(o);
    if (!proc.ok()) {
      *error = proc.status().ToString();
      return nullptr;
    }
    auto p = std::unique_ptr<OwnerProcess>(new OwnerProcess(std::move(proc).value()));
    for (;;) {
      auto line = p->proc_->ReadLine(std::chrono::seconds(300));
      if (!line.ok()) break;
      if (*line == "READY") return p;
      p->lines_.push_back(*line);
    }
    *error = "rc_gpu_owner exited or hung before READY (see its stderr above)";
    return nullptr;
  }
  ~OwnerProcess() {
    proc_->CloseStdin();
    // The Subprocess destructor SIGKILLs and reaps it when it did not exit in 5 s.
    (void)proc_->Wait(std::chrono::seconds(5));
  }
  // Lines printed before READY ("KEY value").
  std::string Value(const std::string& key) const {
    for (const std::string& l : lines_) {
      if (l.rfind(key + " ", 0) == 0) return l.substr(key.size() + 1);
    }
    return "";
  }
  pid_t pid() const { return proc_->pid(); }
  void Kill() { proc_->Kill(); }

 private:
  explicit OwnerProcess(std::unique_ptr<Subprocess> proc) : proc_(std::move(proc)) {}
  std::unique_ptr<Subprocess> proc_;
  std::vector<std::string> lines_;
};

inline refit::Manifest ReadManifest(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return refit::ManifestFromJson(ParseJson(ss.str(), path).value()).value();
}

// The staging capture the vLLM extension builds for a live capture: copy i lands densely in its
// own staging parameter "rc.staging.i" of the live parameter's dtype (as digest_table_test.cc).
inline refit::Capture StagingFor(const refit::Capture& live) { return refit::DenseStagingCapture(live); }

// The host reference of an install: every copy of `live` writes its staged parameter (the dense
// staging parameter i of StagingFor(live), in `host` by name) into the host image of its live
// parameter (also in `host`), element by element.
inline void InstallStagedOnHost(const refit::Capture& live, const refit::Capture& staging,
                                std::map<std::string, std::vector<std::byte>>* host) {
  for (size_t i = 0; i < live.copies.size(); ++i) {
    const refit::CapturedCopy& c = live.copies[i];
    const size_t es = refit::DTypeSize(live.params[c.param].dtype);
    const refit::Shape dense = refit::RowMajorStrides(c.dest_shape);
    auto& dst = (*host)[live.params[c.param].name];
    const auto& src = host->at(staging.params[i].name);
    for (int64_t e = 0; e < refit::NumElements(c.dest_shape); ++e) {
      int64_t rest = e, soff = 0, doff = c.dest_offset;
      for (size_t k = c.dest_shape.size(); k-- > 0;) {
        const int64_t idx = rest % c.dest_shape[k];
        rest /= c.dest_shape[k];
        soff += idx * dense[k];
        doff += idx * c.dest_strides[k];
      }
      std::memcpy(dst.data() + doff * es, src.data() + soff * es, es);
    }
  }
}

}  // namespace rc::cuda::testing
