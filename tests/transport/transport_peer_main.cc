// rc_transport_peer: the owner half of the cross-process transport tests and benchmark.
//
//   rc_transport_peer <backend shm|ucx> <seed> <size0> [<size1> ...]
// Allocates one region per size (shm: a ShmBuffer each; ucx: page-aligned heap memory), fills
// it with FillPeerBytes(seed, index, ...), registers it and prints "DESC <index> <descriptor>"
// per region, then "READY". Afterwards it reads commands from stdin, one per line:
//   DEREG <index>   deregister region <index>, answer "OK" or "ERR <status>"
//   PING            answer "PONG"
// and exits on EOF. Exit status 2 on any setup failure (the reason goes to stderr).
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "rolloutcore/transport/shm.h"
#include "transport/peer_data.h"
#ifdef RC_HAVE_UCX
#include "rolloutcore/transport/ucx.h"
#endif

namespace {

using rc::transport::MemoryRegion;
using rc::transport::Transport;

int Fail(const std::string& why) {
  std::cerr << "rc_transport_peer: " << why << "\n";
  return 2;
}

struct FreeDeleter {
  void operator()(std::byte* p) const { std::free(p); }
};

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4) return Fail("usage: rc_transport_peer <shm|ucx> <seed> <size>...");
  const std::string backend = argv[1];
  const uint64_t seed = std::strtoull(argv[2], nullptr, 10);
  std::vector<uint64_t> sizes;
  for (int i = 3; i < argc; ++i) sizes.push_back(std::strtoull(argv[i], nullptr, 10));

  std::unique_ptr<Transport> transport;
  if (backend == "shm") {
    auto t = rc::transport::CreateShmTransport();
    if (!t.ok()) return Fail(t.status().ToString());
    transport = std::move(t).value();
#ifdef RC_HAVE_UCX
  } else if (backend == "ucx") {
    auto t = rc::transport::CreateUcxTransport();
    if (!t.ok()) return Fail(t.status().ToString());
    transport = std::move(t).value();
#endif
  } else {
    return Fail("unknown or unbuilt backend " + backend);
  }

  std::vector<rc::transport::ShmBuffer> shm_buffers;
  std::vector<std::unique_ptr<std::byte, FreeDeleter>> heap_buffers;
  std::vector<uint64_t> ids;
  for (size_t r = 0; r < sizes.size(); ++r) {
    std::byte* data = nullptr;
    if (backend == "shm") {
      auto b = rc::transport::ShmBuffer::Create(sizes[r]);
      if (!b.ok()) return Fail(b.status().ToString());
      shm_buffers.push_back(std::move(b).value());
      data = shm_buffers.back().data();
    } else {
      const uint64_t rounded = (sizes[r] + 4095) / 4096 * 4096;
      heap_buffers.emplace_back(static_cast<std::byte*>(std::aligned_alloc(4096, rounded)));
      data = heap_buffers.back().get();
      if (data == nullptr) return Fail("out of memory");
    }
    rc::transport::testing::FillPeerBytes(seed, r, 0, data, sizes[r]);
    auto reg = transport->RegisterMemory(MemoryRegion{data, sizes[r]});
    if (!reg.ok()) return Fail(reg.status().ToString());
    ids.push_back(reg->id);
    std::cout << "DESC " << r << " " << reg->descriptor << "\n";
  }
  std::cout << "READY" << std::endl;

  std::string cmd;
  while (std::cin >> cmd) {
    if (cmd == "DEREG") {
      size_t index = 0;
      std::cin >> index;
      const rc::Status s = index < ids.size() ? transport->Deregister(ids[index])
                                               : rc::InvalidArgument("no region " + std::to_string(index));
      std::cout << (s.ok() ? std::string("OK") : "ERR " + s.ToString()) << std::endl;
    } else if (cmd == "PING") {
      std::cout << "PONG" << std::endl;
    } else {
      std::cout << "ERR unknown command " << cmd << std::endl;
    }
  }
  return 0;
}
