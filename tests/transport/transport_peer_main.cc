// rc_transport_peer: the owner half of the cross-process transport tests and benchmark.
//
//   rc_transport_peer <backend shm|ucx> <seed> [<size0> <size1> ...]
// Allocates one region per size (shm: a ShmBuffer each; ucx: page-aligned heap memory), fills
// it with FillPeerBytes(seed, index, ...), registers it and prints "DESC <index> <descriptor>"
// per region, then "READY" (no sizes: no regions, just READY). Afterwards it reads commands from
// stdin, one per line:
//   DEREG <index>   deregister region <index>, answer "OK" or "ERR <status>"
//   PING            answer "PONG"
// and, for an owner that serves memory of the parent process (the conformance suite's ucx env,
// tests/transport/transport_conformance_test.cc):
//   REGSHM <pid> <fd> <offset> <length>
//                   maps memfd <fd> of process <pid> (a ShmBuffer of the parent: /proc/<pid>/fd/<fd>,
//                   read-write, shared, so the parent's writes are what readers get) and registers
//                   bytes [offset, offset + length) of it; answers "REG <id> <descriptor>" or
//                   "ERR <status>". The mapping stays until exit (a reader may still reach the
//                   range after Deregister where the backend says so, see ucx.h).
//   REGKIND <host|device> <device> <length>
//                   registers <length> bytes of this process's own scratch memory declared as that
//                   kind: the backend's own answer to the memory kind (Unimplemented where
//                   unsupported); same answers as REGSHM
//   DEREGID <id>    Deregister(<id>) of a registration id as REGSHM/REGKIND returned it; "OK" or
//                   "ERR <status>" (a second one is the backend's NotFound)
// and exits on EOF. Exit status 2 on any setup failure (the reason goes to stderr). <status> is
// Status::ToString(): "<code name>: <message>".
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
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

std::string Answer(const rc::Result<rc::transport::Registration>& reg) {
  if (!reg.ok()) return "ERR " + reg.status().ToString();
  return "REG " + std::to_string(reg->id) + " " + reg->descriptor;
}

// Maps memfd `fd` of process `pid` shared and read-write; the mapping is never unmapped.
rc::Result<std::byte*> MapPeerMemfd(pid_t pid, int fd, uint64_t offset, uint64_t length) {
  const std::string path = "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(fd);
  const int mine = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (mine < 0) return rc::Unavailable("open " + path + ": " + std::strerror(errno));
  struct stat st {};
  if (::fstat(mine, &st) != 0 || offset > static_cast<uint64_t>(st.st_size) ||
      length > static_cast<uint64_t>(st.st_size) - offset) {
    ::close(mine);
    return rc::InvalidArgument("REGSHM: bytes [" + std::to_string(offset) + ", +" + std::to_string(length) +
                               ") are not inside " + path + " of " + std::to_string(st.st_size) + " bytes");
  }
  void* p = ::mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ | PROT_WRITE, MAP_SHARED, mine, 0);
  ::close(mine);
  if (p == MAP_FAILED) return rc::Unavailable("mmap " + path + ": " + std::strerror(errno));
  return static_cast<std::byte*>(p) + offset;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) return Fail("usage: rc_transport_peer <shm|ucx> <seed> [<size>...]");
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
    } else if (cmd == "REGSHM") {
      long long pid = 0;
      int fd = -1;
      uint64_t offset = 0, length = 0;
      std::cin >> pid >> fd >> offset >> length;
      auto data = MapPeerMemfd(static_cast<pid_t>(pid), fd, offset, length);
      std::cout << (data.ok() ? Answer(transport->RegisterMemory(MemoryRegion{*data, length}))
                              : "ERR " + data.status().ToString())
                << std::endl;
    } else if (cmd == "REGKIND") {
      std::string kind;
      int device = -1;
      uint64_t length = 0;
      std::cin >> kind >> device >> length;
      if ((kind != "host" && kind != "device") || length == 0) {
        std::cout << "ERR " << rc::InvalidArgument("REGKIND " + kind + " " + std::to_string(length)).ToString()
                  << std::endl;
        continue;
      }
      const uint64_t rounded = (length + 4095) / 4096 * 4096;
      heap_buffers.emplace_back(static_cast<std::byte*>(std::aligned_alloc(4096, rounded)));
      if (heap_buffers.back() == nullptr) return Fail("out of memory");
      const MemoryRegion region{heap_buffers.back().get(), length,
                                kind == "host" ? rc::transport::MemoryKind::kHost : rc::transport::MemoryKind::kDevice,
                                device};
      std::cout << Answer(transport->RegisterMemory(region)) << std::endl;
    } else if (cmd == "DEREGID") {
      uint64_t id = 0;
      std::cin >> id;
      const rc::Status s = transport->Deregister(id);
      std::cout << (s.ok() ? std::string("OK") : "ERR " + s.ToString()) << std::endl;
    } else if (cmd == "PING") {
      std::cout << "PONG" << std::endl;
    } else {
      std::cout << "ERR unknown command " << cmd << std::endl;
    }
  }
  return 0;
}
