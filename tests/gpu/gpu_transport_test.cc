// The GPU data plane end to end (label gpu; each case skips without enough CUDA devices):
//   * the same plan over cuda_ipc / nccl into device parameters gives byte-identical tensors to
//     the CPU `local` path (tiny model, trainer fsdp:2 -> engine tp:2 and tp:1, f32 and bf16
//     parameters), owner in another process and in this process;
//   * the GPU digest of what was installed equals the CPU digest and the owner's shard digests;
//   * an owner killed in the middle of a transfer is detected (Unavailable) well within the
//     deadline, over cuda_ipc and over nccl.
#include <arpa/inet.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <map>
#include <thread>

#include "gpu/gpu_test_util.h"
#include "rolloutcore/cuda/gpu_refit.h"
#include "rolloutcore/refit/executor.h"
#include "rolloutcore/refit/layouts.h"
#include "rolloutcore/refit/planner.h"
#include "rolloutcore/transport/registry.h"
#ifdef ROLLOUTCORE_HAVE_NCCL
#include "rolloutcore/transport/nccl.h"
#endif

namespace rc::cuda {
namespace {

using testing::HostReference;
using testing::OwnerProcess;

constexpr uint64_t kSeed = 1234;

struct Installed {
  std::map<std::string, std::vector<std::byte>> bytes;  // by parameter
  refit::TensorDigests digests;                         // of the regions this rank owns
};

// Plans `capture` against `manifest` and runs it through `transport` into zeroed device
// parameters of `device`; returns the bytes and the GPU digest of the owned regions.
Installed RunOnDevice(const refit::Capture& capture, const std::vector<refit::DigestRegion>& regions,
                      const refit::Manifest& manifest, transport::Transport& transport, int device) {
  Installed out;
  auto plan = refit::BuildPlan(capture, manifest);
  EXPECT_TRUE(plan.ok()) << plan.status().ToString();
  if (!plan.ok()) return out;
  std::map<std::string, DeviceBuffer> params;
  refit::DestinationBuffers views;
  for (const refit::TensorSpec& p : capture.params) {
    params[p.name] = DeviceBuffer::Allocate(device, p.bytes()).value();
    EXPECT_TRUE(FillBytes(params[p.name].data(), 0, p.bytes(), device).ok());
    views.emplace(p.name, std::span<std::byte>(params[p.name].data(), p.bytes()));
  }
  DeviceExecuteOptions eo;
  eo.device = device;
  eo.timeout_ms = 60'000;
  eo.max_staging_bytes = 1 << 16;  // several waves even on the tiny model
  auto stats = ExecutePlanOnDevice(*plan, transport, views, eo);
  EXPECT_TRUE(stats.ok()) << stats.status().ToString();
  for (const refit::TensorSpec& p : capture.params) {
    auto& b = out.bytes[p.name];
    b.resize(p.bytes());
    EXPECT_TRUE(CopyToHost(b.data(), params[p.name].data(), p.bytes(), device).ok());
  }
  auto digest = DeviceDigest::ForInstalled(capture, views, regions, device);
  EXPECT_TRUE(digest.ok()) << digest.status().ToString();
  if (digest.ok()) out.digests = digest->Run().value();
  return out;
}

Installed RunOnHost(const refit::Capture& capture, const std::vector<refit::DigestRegion>& regions,
                    HostReference& ref) {
  Installed out;
  auto plan = refit::BuildPlan(capture, ref.manifest());
  EXPECT_TRUE(plan.ok()) << plan.status().ToString();
  refit::DestinationBuffers views;
  for (const refit::TensorSpec& p : capture.params) {
    out.bytes[p.name].assign(p.bytes(), std::byte{0});
    views.emplace(p.name, std::span<std::byte>(out.bytes[p.name]));
  }
  auto stats = refit::ExecutePlan(*plan, ref.transport(), views);
  EXPECT_TRUE(stats.ok()) << stats.status().ToString();
  out.digests = refit::DigestInstalled(capture, views, regions).value();
  return out;
}

// Every engine layout of the tiny model against the CPU reference.
void CompareWithCpu(const refit::Manifest& gpu_manifest, transport::Transport& transport, int device) {
  auto ref = HostReference::Make(gpu_manifest, kSeed);
  // The owner's GPU shard digests equal the CPU digests of the same seeded bytes.
  for (size_t t = 0; t < gpu_manifest.tables.size(); ++t) {
    for (size_t s = 0; s < gpu_manifest.tables[t].shards.size(); ++s) {
      ASSERT_EQ(gpu_manifest.tables[t].shards[s].digest, ref->manifest().tables[t].shards[s].digest)
          << gpu_manifest.tables[t].name << " shard " << s;
    }
  }
  const auto config = refit::ModelPreset("tiny").value();
  const refit::TensorDigests published = refit::TensorDigestsFromShards(gpu_manifest).value();
  for (const char* text : {"tp:2", "tp:2@bf16", "tp:1@bf16"}) {
    const auto layout = refit::ParseEngineLayout(text).value();
    std::vector<refit::Capture> captures;
    for (int32_t r = 0; r < layout.world_size(); ++r) captures.push_back(refit::CaptureEngineRank(config, layout, r).value());
    std::vector<const refit::Capture*> ptrs;
    for (auto& c : captures) ptrs.push_back(&c);
    const auto regions = refit::AssignDigestOwnership(ptrs);
    refit::TensorDigests gpu_total, cpu_total;
    for (size_t r = 0; r < captures.size(); ++r) {
      SCOPED_TRACE(std::string(text) + " rank " + std::to_string(r));
      const Installed gpu = RunOnDevice(captures[r], regions[r], gpu_manifest, transport, device);
      const Installed cpu = RunOnHost(captures[r], regions[r], *ref);
      for (const auto& [name, bytes] : cpu.bytes) {
        ASSERT_EQ(gpu.bytes.at(name).size(), bytes.size()) << name;
        EXPECT_TRUE(gpu.bytes.at(name) == bytes) << "parameter " << name << " differs from the CPU local path";
      }
      EXPECT_EQ(gpu.digests, cpu.digests);
      refit::AddDigests(gpu_total, gpu.digests);
      refit::AddDigests(cpu_total, cpu.digests);
    }
    // Summed over ranks, the installed digests are the published ones (f32 params: bf16 widened
    // exactly, so they map back to the source bits).
    EXPECT_EQ(gpu_total, published) << text;
    EXPECT_EQ(cpu_total, published) << text;
  }
}

int ReaderDevice() { return DeviceCount() > 1 ? 1 : 0; }

std::string TempPath(const std::string& name) {
  return ::testing::TempDir() + "/" + name + "-" + std::to_string(::getpid()) + ".json";
}

TEST(GpuTransportTest, CudaIpcCrossProcessMatchesLocal) {
  RC_SKIP_WITHOUT_GPUS(1);
  const std::string path = TempPath("cuda-ipc-manifest");
  std::string error;
  auto owner = OwnerProcess::Spawn({"model", "cuda_ipc", "0", "tiny", "fsdp:2", std::to_string(kSeed), path}, &error);
  ASSERT_NE(owner, nullptr) << error;
  transport::TransportOptions to;
  to.device = ReaderDevice();
  auto t = transport::CreateTransport("cuda_ipc", to);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  CompareWithCpu(testing::ReadManifest(path), **t, ReaderDevice());
}

TEST(GpuTransportTest, CudaIpcSameProcessMatchesLocal) {
  RC_SKIP_WITHOUT_GPUS(1);
  GpuOwnerOptions o;
  o.config = refit::ModelPreset("tiny").value();
  o.layout = refit::ParseTrainerLayout("fsdp:2").value();
  o.transport = "cuda_ipc";
  o.device = 0;
  o.seed = kSeed;
  auto owner = GpuOwner::Start(o);
  ASSERT_TRUE(owner.ok()) << owner.status().ToString();
  transport::TransportOptions to;
  to.device = ReaderDevice();
  auto t = transport::CreateTransport("cuda_ipc", to);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  CompareWithCpu((*owner)->manifest(), **t, ReaderDevice());
}

TEST(GpuTransportTest, NcclCrossProcessMatchesLocal) {
  RC_SKIP_WITHOUT_GPUS(2);
  ::setenv("NCCL_NVLS_ENABLE", "0", 1);
  const std::string path = TempPath("nccl-manifest");
  std::string error;
  auto owner = OwnerProcess::Spawn({"model", "nccl", "0", "tiny", "fsdp:2", std::to_string(kSeed), path}, &error);
  ASSERT_NE(owner, nullptr) << error;
  transport::TransportOptions to;
  to.device = 1;
  auto t = transport::CreateTransport("nccl", to);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  CompareWithCpu(testing::ReadManifest(path), **t, 1);
}

TEST(GpuTransportTest, NcclSameProcessMatchesLocal) {
  RC_SKIP_WITHOUT_GPUS(2);
  GpuOwnerOptions o;
  o.config = refit::ModelPreset("tiny").value();
  o.layout = refit::ParseTrainerLayout("fsdp:2").value();
  o.transport = "nccl";
  o.device = 0;
  o.seed = kSeed;
  auto owner = GpuOwner::Start(o);
  ASSERT_TRUE(owner.ok()) << owner.status().ToString();
  transport::TransportOptions to;
  to.device = 1;
  auto t = transport::CreateTransport("nccl", to);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  CompareWithCpu((*owner)->manifest(), **t, 1);
}

TEST(GpuTransportTest, CudaIpcImportOfDeadOwnerIsUnavailable) {
  RC_SKIP_WITHOUT_GPUS(1);
  std::string error;
  auto owner = OwnerProcess::Spawn({"blob", "cuda_ipc", "0", "4096"}, &error);
  ASSERT_NE(owner, nullptr) << error;
  const std::string desc = owner->Value("DESC");
  owner->Kill();
  auto t = transport::CreateTransport("cuda_ipc", {nullptr, ReaderDevice()});
  ASSERT_TRUE(t.ok());
  auto r = (*t)->Import(desc);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kUnavailable) << r.status().ToString();
  EXPECT_NE(r.status().message().find(std::to_string(owner->pid())), std::string::npos) << r.status().message();
}

// Reads a large region of an owner process, SIGKILLs the owner right after posting, and checks
// the transfer fails with Unavailable well within its deadline.
void KillOwnerMidTransfer(const std::string& backend, int owner_device, int reader_device) {
  const uint64_t bytes = uint64_t{8} << 30;  // ~20-40 ms over NVLink: the kill lands mid-transfer
  std::string error;
  auto owner = OwnerProcess::Spawn({"blob", backend, std::to_string(owner_device), std::to_string(bytes)}, &error);
  ASSERT_NE(owner, nullptr) << error;
  auto t = transport::CreateTransport(backend, {nullptr, reader_device});
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  auto remote = (*t)->Import(owner->Value("DESC"));
  ASSERT_TRUE(remote.ok()) << remote.status().ToString();
  auto dest = DeviceBuffer::Allocate(reader_device, bytes).value();
  // Many ops, so the reads are spread over the streams / one NCCL group.
  std::vector<transport::ReadOp> ops;
  const uint64_t op_bytes = uint64_t{64} << 20;
  for (uint64_t off = 0; off < bytes; off += op_bytes) ops.push_back({*remote, off, dest.data() + off, op_bytes});
  const int64_t deadline_ms = 20'000;
  Clock& clock = (*t)->clock();
  const int64_t deadline = clock.NowNs() + deadline_ms * 1'000'000;
  auto transfer = (*t)->PostReads(ops);
  ASSERT_TRUE(transfer.ok()) << transfer.status().ToString();
  const auto killed = std::chrono::steady_clock::now();
  owner->Kill();
  const Status s = (*transfer)->Wait(deadline);
  const double detect_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - killed).count();
  EXPECT_FALSE(s.ok()) << backend << ": a transfer from a killed owner must not report success";
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.ToString();
  EXPECT_LT(detect_ms, 5000.0) << backend << " took " << detect_ms << " ms to notice the dead owner";
  std::cerr << backend << ": killed owner detected after " << detect_ms << " ms: " << s.ToString() << "\n";
  transfer->reset();
  (void)(*t)->ReleaseRemote(*remote);
}

TEST(GpuTransportTest, CudaIpcKilledOwnerIsDetectedWithinDeadline) {
  RC_SKIP_WITHOUT_GPUS(1);
  KillOwnerMidTransfer("cuda_ipc", 0, ReaderDevice());
}

TEST(GpuTransportTest, NcclKilledOwnerIsDetectedWithinDeadline) {
  RC_SKIP_WITHOUT_GPUS(2);
  ::setenv("NCCL_NVLS_ENABLE", "0", 1);
  KillOwnerMidTransfer("nccl", 0, 1);
}

// Import under its deadline (nccl.h, connect_timeout_ns): an owner address that never completes the
// TCP handshake (a listener with a full accept queue: its kernel drops our SYNs) and one that
// accepts but never answers the hello. Both end with DeadlineExceeded naming the owner, within the
// deadline plus a small constant. Needs a device only to create the nccl transport; no NCCL peer.
#ifdef ROLLOUTCORE_HAVE_NCCL
TEST(GpuTransportTest, NcclImportOfAnUnresponsiveOwnerEndsAtItsDeadline) {
  RC_SKIP_WITHOUT_GPUS(1);
  ::setenv("NCCL_NVLS_ENABLE", "0", 1);
  transport::NcclTransportOptions o;
  o.connect_timeout_ns = 500'000'000;
  auto t = transport::CreateNcclTransport({}, o);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  for (const bool accept_queue_full : {true, false}) {
    SCOPED_TRACE(accept_queue_full ? "SYNs dropped" : "hello never answered");
    const int l = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(::bind(l, reinterpret_cast<sockaddr*>(&sa), sizeof sa), 0);
    ASSERT_EQ(::listen(l, accept_queue_full ? 0 : 8), 0);
    socklen_t len = sizeof sa;
    ::getsockname(l, reinterpret_cast<sockaddr*>(&sa), &len);
    const uint16_t port = ntohs(sa.sin_port);
    std::vector<int> fillers;
    for (int i = 0; accept_queue_full && i < 8; ++i) {
      const int f = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
      (void)::connect(f, reinterpret_cast<sockaddr*>(&sa), sizeof sa);
      fillers.push_back(f);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    // This process stands in for the owner: alive, so only the deadline can end the wait.
    const std::string desc = fmt::format("nccl:v1:host=127.0.0.1:port={}:pid={}:tok=0123456789abcdef:id=1:dev=0:len=4096",
                                         port, ::getpid());
    const auto start = std::chrono::steady_clock::now();
    auto r = (*t)->Import(desc);
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    for (int f : fillers) ::close(f);
    ::close(l);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kDeadlineExceeded) << r.status().ToString();
    EXPECT_NE(r.status().message().find(fmt::format("owner pid {} at 127.0.0.1:{}", ::getpid(), port)),
              std::string::npos)
        << r.status().message();
    EXPECT_GE(ms, 400.0);
    EXPECT_LT(ms, 3000.0);
  }
}
#endif  // ROLLOUTCORE_HAVE_NCCL

}  // namespace
}  // namespace rc::cuda
