// The transport conformance suite (src/transport/transport_conformance.h) over the GPU backends:
// cuda_ipc and nccl (label gpu; cases skip without the devices they need). Owner and reader are
// two transports of this process: the owner on device 0, the reader on device 1 when there is one
// (cuda_ipc: else device 0 too; it serves its own process's descriptors without IPC) -- nccl needs
// two devices (a 2-rank communicator cannot put both ranks on one GPU). Sources are cudaMalloc
// memory of the owner's device, destinations of the reader's, written and read back with
// cudaMemcpy. The dead-owner case uses an rc_gpu_owner child killed and reaped.
#include <fmt/format.h>

#include "gpu/gpu_test_util.h"
#include "transport/transport_conformance.h"

namespace rc::transport::testing {
namespace {

using cuda::DeviceBuffer;

constexpr int kOwnerDevice = 0;

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

Result<std::unique_ptr<TestBuffer>> DeviceZeros(int device, uint64_t bytes) {
  RC_ASSIGN_OR_RETURN(DeviceBuffer b, DeviceBuffer::Allocate(device, bytes));
  RC_RETURN_IF_ERROR(cuda::FillBytes(b.data(), 0, bytes, device));
  return std::unique_ptr<TestBuffer>(std::make_unique<DeviceTestBuffer>(std::move(b)));
}

class GpuEnv final : public TransportEnv {
 public:
  GpuEnv(std::string backend, int reader_device, std::unique_ptr<Transport> owner, std::unique_ptr<Transport> reader)
      : backend_(std::move(backend)),
        reader_device_(reader_device),
        owner_(std::move(owner)),
        reader_(std::move(reader)) {}
  Transport& owner() override { return *owner_; }
  Transport& reader() override { return *reader_; }
  Result<std::unique_ptr<TestBuffer>> Allocate(uint64_t bytes) override { return DeviceZeros(reader_device_, bytes); }
  Result<std::unique_ptr<TestBuffer>> AllocateSource(uint64_t bytes) override {
    return DeviceZeros(kOwnerDevice, bytes);
  }
  Result<std::string> DeadOwnerDescriptor() override {
    std::string error;
    auto owner = cuda::testing::OwnerProcess::Spawn({"blob", backend_, std::to_string(kOwnerDevice), "4096"}, &error);
    if (owner == nullptr) return Unavailable(error);
    const std::string d = owner->Value("DESC");
    owner->Kill();  // SIGKILL and reap
    return d;
  }

 private:
  std::string backend_;
  int reader_device_;
  std::unique_ptr<Transport> owner_;
  std::unique_ptr<Transport> reader_;
};

std::function<std::unique_ptr<TransportEnv>(std::string*)> MakeGpu(const std::string& backend) {
  return [backend](std::string* skip) -> std::unique_ptr<TransportEnv> {
    const int devices = cuda::DeviceCount();
    const int needed = backend == "nccl" ? 2 : 1;
    if (devices < needed) {
      *skip = fmt::format("{} needs {} CUDA device(s), found {}", backend, needed, devices);
      return nullptr;
    }
    const int reader_device = devices > 1 ? 1 : 0;
    TransportOptions o;
    o.device = kOwnerDevice;
    auto owner = CreateTransport(backend, o);
    o.device = reader_device;
    auto reader = CreateTransport(backend, o);
    if (!owner.ok() || !reader.ok()) {
      *skip = (owner.ok() ? reader.status() : owner.status()).ToString();
      return nullptr;
    }
    return std::make_unique<GpuEnv>(backend, reader_device, std::move(owner).value(), std::move(reader).value());
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
