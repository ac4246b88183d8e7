// rc_gpu_owner: the trainer side of the GPU tests, as a separate process.
//
//   rc_gpu_owner model <transport> <device> <preset> <trainer layout> <seed> <manifest path>
//       GpuOwner with seeded weights; writes the manifest (JSON) to the path.
//   rc_gpu_owner blob <transport> <device> <bytes>
//       one device buffer of <bytes> seeded bytes, registered whole; prints "DESC <descriptor>".
// Then prints READY and waits until its stdin closes (or it is killed).
#include <cstdio>
#include <fstream>
#include <iostream>
#include <string>

#include "rolloutcore/cuda/gpu_refit.h"
#include "rolloutcore/refit/layouts.h"
#include "rolloutcore/refit/model_config.h"
#include "rolloutcore/transport/registry.h"

namespace {

int Fail(const std::string& what) {
  std::cerr << "rc_gpu_owner: " << what << "\n";
  return 1;
}

void WaitForEof() {
  char buf[64];
  while (std::fread(buf, 1, sizeof buf, stdin) > 0) {
  }
}

}  // namespace

int main(int argc, char** argv) {
  using namespace rc;
  if (argc < 5) return Fail("usage: rc_gpu_owner model|blob <transport> <device> ...");
  const std::string mode = argv[1], transport_name = argv[2];
  const int device = std::stoi(argv[3]);
  if (mode == "model" && argc == 8) {
    auto config = refit::ResolveModelSpec(argv[4]);
    if (!config.ok()) return Fail(config.status().ToString());
    auto layout = refit::ParseTrainerLayout(argv[5]);
    if (!layout.ok()) return Fail(layout.status().ToString());
    cuda::GpuOwnerOptions o;
    o.config = *config;
    o.layout = *layout;
    o.transport = transport_name;
    o.device = device;
    o.seed = std::stoull(argv[6]);
    auto owner = cuda::GpuOwner::Start(o);
    if (!owner.ok()) return Fail(owner.status().ToString());
    std::ofstream(argv[7]) << refit::ManifestToJson((*owner)->manifest()).dump();
    std::cout << "MANIFEST " << argv[7] << "\nREADY" << std::endl;
    WaitForEof();
    return 0;
  }
  if (mode == "blob" && argc == 5) {
    const uint64_t bytes = std::stoull(argv[4]);
    transport::TransportOptions to;
    to.device = device;
    auto t = transport::CreateTransport(transport_name, to);
    if (!t.ok()) return Fail(t.status().ToString());
    auto buf = cuda::DeviceBuffer::Allocate(device, bytes);
    if (!buf.ok()) return Fail(buf.status().ToString());
    Status s = cuda::FillSeeded(device, buf->data(), refit::DType::kU8, 7, {static_cast<int64_t>(bytes)},
                                refit::Box{{0}, {static_cast<int64_t>(bytes)}});
    char first = 0;
    if (s.ok()) s = cuda::CopyToHost(&first, buf->data(), 1, device);  // waits for the fill
    if (!s.ok()) return Fail(s.ToString());
    auto reg = (*t)->RegisterMemory({buf->data(), bytes, transport::MemoryKind::kDevice, device});
    if (!reg.ok()) return Fail(reg.status().ToString());
    std::cout << "DESC " << reg->descriptor << "\nREADY" << std::endl;
    WaitForEof();
    return 0;
  }
  return Fail("bad arguments (see the header of gpu_owner_main.cc)");
}
