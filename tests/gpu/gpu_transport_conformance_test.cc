// The transport conformance suite (src/transport/transport_conformance.h) over the GPU backends:
// cuda_ipc and nccl (label gpu; every case skips without a CUDA device). Owner and reader are two
// transports of this process on device 0 (cuda_ipc serves its own process's descriptors without
// IPC; nccl builds a 2-rank communicator between them); buffers are cudaMalloc memory written and
// read back with cudaMemcpy. The dead-owner case uses an rc_gpu_owner child killed and reaped.
#include "gpu/gpu_test_util.h"
#include "transport/transport_conformance.h"

namespace rc::transport::testing {
namespace {

using cuda::DeviceBuffer;

constexpr int kDevice = 0;

class DeviceTestBuffer final : public TestBuffer {
 public:
  explicit DeviceTestBuffer(DeviceBuffer b) : b_(std::move(b)) {}
  MemoryRegion region() const override { return {b_.data(), b_.size(), MemoryKind::kDevice, b_.device()}; }
  Status Write(uint64_t offset, const void* src, uint64_t n) override {
    return cuda::CopyToDevice(b_.data() + offset, src, n, b_.device());
  }
  Status Read(uint64_t offset, void* dst, uint64_t n) const override {
    return cuda::CopyToHost(dst, b_.data() + offset, n, b_.device());
  }

 private:
  DeviceBuffer b_;
};

class GpuEnv final : public TransportEnv {
 public:
  GpuEnv(std::string backend, std::unique_ptr<Transport> owner, std::unique_ptr<Transport> reader)
      : backend_(std::move(backend)), owner_(std::move(owner)), reader_(std::move(reader)) {}
  Transport& owner() override { return *owner_; }
  Transport& reader() override { return *reader_; }
  Result<std::unique_ptr<TestBuffer>> Allocate(uint64_t bytes) override {
    RC_ASSIGN_OR_RETURN(DeviceBuffer b, DeviceBuffer::Allocate(kDevice, bytes));
    RC_RETURN_IF_ERROR(cuda::FillBytes(b.data(), 0, bytes, kDevice));
    return std::unique_ptr<TestBuffer>(std::make_unique<DeviceTestBuffer>(std::move(b)));
  }
  Result<std::string> DeadOwnerDescriptor() override {
    std::string error;
    auto owner = cuda::testing::OwnerProcess::Spawn({"blob", backend_, std::to_string(kDevice), "4096"}, &error);
    if (owner == nullptr) return Unavailable(error);
    const std::string d = owner->Value("DESC");
    owner->Kill();  // SIGKILL and reap
    return d;
  }

 private:
  std::string backend_;
  std::unique_ptr<Transport> owner_;
  std::unique_ptr<Transport> reader_;
};

std::function<std::unique_ptr<TransportEnv>(std::string*)> MakeGpu(const std::string& backend) {
  return [backend](std::string* skip) -> std::unique_ptr<TransportEnv> {
    if (cuda::DeviceCount() < 1) {
      *skip = "no CUDA device";
      return nullptr;
    }
    TransportOptions o;
    o.device = kDevice;
    auto owner = CreateTransport(backend, o);
    auto reader = CreateTransport(backend, o);
    if (!owner.ok() || !reader.ok()) {
      *skip = (owner.ok() ? reader.status() : owner.status()).ToString();
      return nullptr;
    }
    return std::make_unique<GpuEnv>(backend, std::move(owner).value(), std::move(reader).value());
  };
}

std::vector<TransportParam> GpuBackends() {
  std::vector<TransportParam> out;
#ifdef ROLLOUTCORE_HAVE_CUDA_IPC
  out.push_back({"cuda_ipc", MakeGpu("cuda_ipc")});
#endif
#ifdef ROLLOUTCORE_HAVE_NCCL
  out.push_back({"nccl", MakeGpu("nccl")});
#endif
  return out;
}

INSTANTIATE_TEST_SUITE_P(GpuBackends, TransportConformanceTest, ::testing::ValuesIn(GpuBackends()), ParamName);

}  // namespace
}  // namespace rc::transport::testing
