// In-process tests of the shm transport (owner and reader in one process, reaching the memfd
// through /proc/self). Cross-process behaviour is tested in tests/transport/.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <future>
#include <numeric>
#include <random>
#include <vector>

#include "rolloutcore/transport/shm.h"
#include "transport/shm/shm_descriptor.h"
#include "transport/descriptor_test_util.h"

namespace rc::transport {
namespace {

using shm_internal::FormatShmDescriptor;
using shm_internal::ParseShmDescriptor;
using shm_internal::ShmDescriptor;

constexpr int64_t kFar = INT64_MAX;

void Fill(std::byte* p, uint64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  for (uint64_t i = 0; i < n; ++i) p[i] = static_cast<std::byte>(rng() >> 56);
}

std::unique_ptr<Transport> MakeShm(ShmTransportOptions o = {}, Clock* clock = nullptr) {
  TransportOptions t;
  t.clock = clock;
  auto r = CreateShmTransport(t, o);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return std::move(r).value();
}

TEST(ShmDescriptorTest, RoundTrips) {
  ShmDescriptor d;
  d.pid = 4242;
  d.fd = 17;
  d.token = 0xdeadbeefcafef00dULL;
  d.offset = 4096;
  d.length = 123;
  d.ctl_fd = 9;
  d.ctl_token = 0x1234;
  d.slot = 65535;
  d.generation = 77;
  const std::string text = shm_internal::FormatShmDescriptor(d);
  auto p = ParseShmDescriptor(text);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->pid, 4242);
  EXPECT_EQ(p->fd, 17);
  EXPECT_EQ(p->token, d.token);
  EXPECT_EQ(p->offset, 4096u);
  EXPECT_EQ(p->length, 123u);
  EXPECT_EQ(p->ctl_fd, 9);
  EXPECT_EQ(p->ctl_token, 0x1234u);
  EXPECT_EQ(p->slot, 65535u);
  EXPECT_EQ(p->generation, 77u);
}

TEST(ShmDescriptorTest, MalformedNamesTheField) {
  const std::string good = "shm:v1:pid=1:fd=3:tok=ab:off=0:len=8:ctl=4:ctok=cd:slot=0:gen=1";
  ASSERT_TRUE(ParseShmDescriptor(good).ok());
  const std::vector<testing::ParseErrorCase> cases = {
      {"local:v1:1:2:3", "does not start with 'shm:v1:'"},
      {"shm:v2:pid=1", "does not start with"},
      {"shm:v1:pid=1:fd=3:tok=ab:off=0:ctl=4:ctok=cd:slot=0:gen=1", "missing field 'len'"},
      {"shm:v1:pid=1:fd=3:tok=ab:off=0:len=x8:ctl=4:ctok=cd:slot=0:gen=1", "field 'len': 'x8' is not a decimal"},
      {"shm:v1:pid=1:fd=3:tok=zz:off=0:len=8:ctl=4:ctok=cd:slot=0:gen=1", "field 'tok': 'zz' is not a hex"},
      {"shm:v1:pid=1:fd=3:tok=ab:off=0:len=8:ctl=4:ctok=cd:slot=0:gen=1:color=red", "unknown field 'color'"},
      {"shm:v1:pid=1:pid=1:fd=3:tok=ab:off=0:len=8:ctl=4:ctok=cd:slot=0:gen=1", "field 'pid' appears twice"},
      {"shm:v1:pid=1:fd=99999999999:tok=ab:off=0:len=8:ctl=4:ctok=cd:slot=0:gen=1", "field 'fd'"},
      {"shm:v1:pid=1:fd=3:tok=ab:off=0:len=8:ctl=4:ctok=cd:slot=0:gen=0", "field 'gen'"},
      {"shm:v1:pid=0:fd=3:tok=ab:off=0:len=8:ctl=4:ctok=cd:slot=0:gen=1", "field 'pid'"},
      {"shm:v1:pid=1:fd=3:tok=ab:off=0:len=8:ctl=4:ctok=cd:slot=0:gen", "item 'gen' is not key=value"},
      {"shm:v1:pid=1:fd=3:tok=ab:off=18446744073709551615:len=8:ctl=4:ctok=cd:slot=0:gen=1", "overflow"},
  };
  testing::ExpectParseErrors([](const std::string& text) { return ParseShmDescriptor(text); }, cases);
  // The transport refuses them the same way.
  auto t = MakeShm();
  auto imported = t->Import("shm:v1:pid=1:fd=3:tok=ab:off=0:len=8:ctl=4:ctok=cd:slot=0");
  ASSERT_FALSE(imported.ok());
  EXPECT_EQ(imported.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(imported.status().message().find("missing field 'gen'"), std::string::npos);
}

TEST(ShmBufferTest, CreateIsZeroFilledWritableAndRejectsZero) {
  EXPECT_EQ(ShmBuffer::Create(0).status().code(), StatusCode::kInvalidArgument);
  auto b = ShmBuffer::Create(12345);
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  ASSERT_TRUE(b->valid());
  EXPECT_EQ(b->size(), 12345u);
  EXPECT_GE(b->fd(), 0);
  for (uint64_t i = 0; i < b->size(); ++i) ASSERT_EQ(b->data()[i], std::byte{0});
  std::memset(b->data(), 0x5a, b->size());
  ShmBuffer moved = std::move(b).value();
  EXPECT_EQ(moved.data()[12344], std::byte{0x5a});
}

TEST(ShmTransportTest, RefusesMemoryOutsideShmBuffers) {
  auto t = MakeShm();
  std::vector<std::byte> heap(4096);
  auto r = t->RegisterMemory(MemoryRegion{heap.data(), heap.size()});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(r.status().message().find("not inside a live ShmBuffer"), std::string::npos) << r.status().message();
  // Past the end of a buffer is refused too.
  auto b = ShmBuffer::Create(4096).value();
  EXPECT_EQ(t->RegisterMemory(b.region(4000, 200)).status().code(), StatusCode::kFailedPrecondition);
  MemoryRegion dev = b.region();
  dev.kind = MemoryKind::kDevice;
  EXPECT_EQ(t->RegisterMemory(dev).status().code(), StatusCode::kUnimplemented);
}

TEST(ShmTransportTest, CapabilitiesAndName) {
  auto t = MakeShm();
  EXPECT_EQ(t->name(), "shm");
  const Capabilities c = t->capabilities();
  EXPECT_TRUE(c.host_memory);
  EXPECT_TRUE(c.cross_process);
  EXPECT_TRUE(c.asynchronous);
  EXPECT_FALSE(c.device_memory);
  EXPECT_FALSE(c.cross_host);
}

TEST(ShmTransportTest, ScatteredReadsOfASubRangeMatchByteForByte) {
  auto owner = MakeShm();
  auto reader = MakeShm({.copy_threads = 3, .inline_bytes = 1024, .piece_bytes = 64 << 10});
  auto buf = ShmBuffer::Create(3 << 20).value();
  Fill(buf.data(), buf.size(), 7);
  const uint64_t base = 4097;  // odd offset inside the buffer
  const uint64_t len = (2 << 20) + 333;
  auto reg = owner->RegisterMemory(buf.region(base, len));
  ASSERT_TRUE(reg.ok()) << reg.status().ToString();
  auto remote = reader->Import(reg->descriptor);
  ASSERT_TRUE(remote.ok()) << remote.status().ToString();
  EXPECT_EQ(remote->length, len);

  std::mt19937_64 rng(11);
  std::vector<std::byte> dest(len + 4096, std::byte{0xee});
  std::vector<ReadOp> ops;
  std::vector<std::pair<uint64_t, uint64_t>> expect;  // (dest offset, src offset)
  uint64_t dpos = 1;
  while (ops.size() < 500) {
    const uint64_t n = ops.size() % 50 == 0 ? (rng() % (200 << 10)) + 1 : (rng() % 777) + 1;
    const uint64_t s = rng() % (len - n + 1);
    if (dpos + n > dest.size()) break;
    ops.push_back(ReadOp{*remote, s, dest.data() + dpos, n});
    dpos += n + (rng() % 3);
  }
  auto tr = reader->PostReads(ops);
  ASSERT_TRUE(tr.ok()) << tr.status().ToString();
  ASSERT_TRUE((*tr)->Wait(kFar).ok());
  EXPECT_EQ((*tr)->Poll(), TransferState::kDone);
  uint64_t total = 0;
  for (const ReadOp& op : ops) {
    total += op.length;
    ASSERT_EQ(std::memcmp(op.dest, buf.data() + base + op.source_offset, op.length), 0)
        << "op at source offset " << op.source_offset;
  }
  EXPECT_EQ((*tr)->bytes(), total);
  EXPECT_TRUE(reader->ReleaseRemote(*remote).ok());
  EXPECT_EQ(reader->ReleaseRemote(*remote).code(), StatusCode::kNotFound);
  EXPECT_TRUE(owner->Deregister(reg->id).ok());
  EXPECT_EQ(owner->Deregister(reg->id).code(), StatusCode::kNotFound);
}

TEST(ShmTransportTest, MalformedBatchFailsBeforeAnyByteMoves) {
  auto t = MakeShm();
  auto buf = ShmBuffer::Create(1000).value();
  Fill(buf.data(), buf.size(), 1);
  auto reg = t->RegisterMemory(buf.region()).value();
  auto remote = t->Import(reg.descriptor).value();
  std::vector<std::byte> dest(2000, std::byte{0});
  std::vector<ReadOp> ops = {{remote, 0, dest.data(), 10}, {remote, 995, dest.data() + 10, 6}};
  auto tr = t->PostReads(ops);
  ASSERT_FALSE(tr.ok());
  EXPECT_EQ(tr.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(tr.status().message().find("read 1 of batch"), std::string::npos) << tr.status().message();
  EXPECT_EQ(dest[0], std::byte{0});
  RemoteMemory bogus{999999, 10};
  std::vector<ReadOp> ops2 = {{bogus, 0, dest.data(), 1}};
  EXPECT_EQ(t->PostReads(ops2).status().code(), StatusCode::kInvalidArgument);
  std::vector<ReadOp> ops3 = {{remote, 0, nullptr, 1}};
  EXPECT_EQ(t->PostReads(ops3).status().code(), StatusCode::kInvalidArgument);
  // An empty batch is done at once.
  auto empty = t->PostReads({});
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ((*empty)->Poll(), TransferState::kDone);
}

TEST(ShmTransportTest, DeregisteredSourceFailsCleanly) {
  auto owner = MakeShm();
  auto reader = MakeShm();
  auto buf = ShmBuffer::Create(1 << 20).value();
  Fill(buf.data(), buf.size(), 3);
  auto reg = owner->RegisterMemory(buf.region()).value();
  auto remote = reader->Import(reg.descriptor).value();
  std::vector<std::byte> dest(1 << 20);
  std::vector<ReadOp> ops = {{remote, 0, dest.data(), dest.size()}};
  ASSERT_TRUE(reader->PostReads(ops).value()->Wait(kFar).ok());

  ASSERT_TRUE(owner->Deregister(reg.id).ok());
  auto tr = reader->PostReads(ops);
  ASSERT_TRUE(tr.ok());
  Status s = (*tr)->Wait(kFar);
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.ToString();
  EXPECT_NE(s.message().find("deregistered"), std::string::npos) << s.message();
  EXPECT_EQ((*tr)->Poll(), TransferState::kFailed);
  // A fresh import of the stale descriptor is refused.
  auto again = reader->Import(reg.descriptor);
  EXPECT_EQ(again.status().code(), StatusCode::kNotFound) << again.status().ToString();
  // Re-registering the same bytes gives a new generation that works.
  auto reg2 = owner->RegisterMemory(buf.region()).value();
  EXPECT_NE(reg2.descriptor, reg.descriptor);
  auto remote2 = reader->Import(reg2.descriptor).value();
  std::vector<ReadOp> ops2 = {{remote2, 0, dest.data(), dest.size()}};
  EXPECT_TRUE(reader->PostReads(ops2).value()->Wait(kFar).ok());
}

// Issue 13 #6: a descriptor naming a FIFO (here one of this process's fds, a FIFO with no writer:
// opening it for reading would block until a writer appears) must be refused at once, and the
// transport must keep working for real descriptors afterwards.
TEST(ShmTransportTest, ImportOfAFifoFailsFastAndLaterImportsWork) {
  const std::string fifo = ::testing::TempDir() + "/rc_shm_fifo_" + std::to_string(::getpid());
  std::filesystem::remove(fifo);
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0) << std::strerror(errno);
  const int fifo_fd = ::open(fifo.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);  // a reader, no writer
  ASSERT_GE(fifo_fd, 0) << std::strerror(errno);
  auto owner = MakeShm();
  auto reader = MakeShm();
  auto buf = ShmBuffer::Create(1 << 16).value();
  Fill(buf.data(), buf.size(), 9);
  auto reg = owner->RegisterMemory(buf.region()).value();
  ShmDescriptor d = ParseShmDescriptor(reg.descriptor).value();
  ShmDescriptor crafted = d;
  crafted.fd = fifo_fd;  // the data fd now names the FIFO
  auto pending = std::async(std::launch::async, [&] { return reader->Import(FormatShmDescriptor(crafted)); });
  if (pending.wait_for(std::chrono::seconds(3)) != std::future_status::ready) {
    ADD_FAILURE() << "Import of a FIFO blocked for 3 s";
    // Unblock the stuck open (a writer appears), so the test can end.
    const int w = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC);
    if (w >= 0) ::close(w);
  }
  auto r = pending.get();
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition) << r.status().ToString();
  EXPECT_NE(r.status().message().find("FIFO"), std::string::npos) << r.status().message();
  // The control fd naming the FIFO is refused the same way.
  crafted = d;
  crafted.ctl_fd = fifo_fd;
  auto c = reader->Import(FormatShmDescriptor(crafted));
  EXPECT_EQ(c.status().code(), StatusCode::kFailedPrecondition) << c.status().ToString();
  // A legitimate import still works.
  auto remote = reader->Import(reg.descriptor);
  ASSERT_TRUE(remote.ok()) << remote.status().ToString();
  std::vector<std::byte> dest(buf.size());
  std::vector<ReadOp> ops = {{*remote, 0, dest.data(), dest.size()}};
  ASSERT_TRUE(reader->PostReads(ops).value()->Wait(kFar).ok());
  EXPECT_EQ(std::memcmp(dest.data(), buf.data(), dest.size()), 0);
  ::close(fifo_fd);
  std::filesystem::remove(fifo);
}

TEST(ShmTransportTest, DestroyedBufferInvalidatesItsRegistrations) {
  auto owner = MakeShm();
  auto reader = MakeShm();
  auto buf = ShmBuffer::Create(8192).value();
  auto reg = owner->RegisterMemory(buf.region(0, 100)).value();
  auto remote = reader->Import(reg.descriptor).value();
  buf = ShmBuffer();  // frees the memfd's owner-side mapping
  std::vector<std::byte> dest(100);
  std::vector<ReadOp> ops = {{remote, 0, dest.data(), 100}};
  auto tr = reader->PostReads(ops).value();
  EXPECT_EQ(tr->Wait(kFar).code(), StatusCode::kUnavailable);
  // While this reader still maps the memfd, a new import sees the dead registration word.
  EXPECT_EQ(reader->Import(reg.descriptor).status().code(), StatusCode::kNotFound);
  // Once nothing here maps it, the owner's closed fd makes the descriptor unreachable.
  tr.reset();
  ASSERT_TRUE(reader->ReleaseRemote(remote).ok());
  auto again = reader->Import(reg.descriptor);
  EXPECT_EQ(again.status().code(), StatusCode::kUnavailable) << again.status().ToString();
  EXPECT_TRUE(owner->Deregister(reg.id).ok());
}

TEST(ShmTransportTest, LargeBatchUsesThePoolAndMatches) {
  auto t = MakeShm({.copy_threads = 2, .inline_bytes = 64 << 10, .piece_bytes = 1 << 20});
  const uint64_t n = 48ull << 20;
  auto buf = ShmBuffer::Create(n).value();
  Fill(buf.data(), n, 99);
  auto reg = t->RegisterMemory(buf.region()).value();
  auto remote = t->Import(reg.descriptor).value();
  std::vector<std::byte> dest(n);
  std::vector<ReadOp> ops;
  for (uint64_t off = 0; off < n; off += 3 << 20) {
    ops.push_back({remote, off, dest.data() + off, std::min<uint64_t>(3 << 20, n - off)});
  }
  auto tr = t->PostReads(ops).value();
  ASSERT_TRUE(tr->Wait(kFar).ok());
  EXPECT_EQ(std::memcmp(dest.data(), buf.data(), n), 0);
}

TEST(ShmTransportTest, DeadlineExceededWhilePendingThenCompletes) {
  ManualClock clock(1'000'000);
  auto t = MakeShm({.copy_threads = 1, .inline_bytes = 64 << 10, .piece_bytes = 4 << 20}, &clock);
  const uint64_t n = 256ull << 20;
  auto buf = ShmBuffer::Create(n).value();
  std::memset(buf.data(), 0x3c, n);
  auto reg = t->RegisterMemory(buf.region()).value();
  auto remote = t->Import(reg.descriptor).value();
  std::vector<std::byte> dest(n);  // untouched pages: the copy also faults them in
  std::vector<ReadOp> ops = {{remote, 0, dest.data(), n}};
  auto tr = t->PostReads(ops).value();
  Status s = tr->Wait(clock.NowNs());
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded) << s.ToString();
  EXPECT_EQ(tr->status().code(), StatusCode::kUnavailable);  // "pending"
  ASSERT_TRUE(tr->Wait(kFar).ok());
  EXPECT_EQ(dest[n - 1], std::byte{0x3c});
  EXPECT_EQ(dest[0], std::byte{0x3c});
}

TEST(ShmTransportTest, CancelStopsPendingPiecesAndEndsAborted) {
  auto t = MakeShm({.copy_threads = 1, .inline_bytes = 64 << 10, .piece_bytes = 1 << 20});
  const uint64_t n = 256ull << 20;
  auto buf = ShmBuffer::Create(n).value();
  std::memset(buf.data(), 0x11, n);
  auto reg = t->RegisterMemory(buf.region()).value();
  auto remote = t->Import(reg.descriptor).value();
  std::vector<std::byte> dest(n, std::byte{0});
  std::vector<ReadOp> ops = {{remote, 0, dest.data(), n}};
  auto tr = t->PostReads(ops).value();
  tr->Cancel();
  Status s = tr->Wait(kFar);
  EXPECT_EQ(s.code(), StatusCode::kAborted) << s.ToString();
  EXPECT_EQ(tr->Poll(), TransferState::kFailed);
  // Most of the destination was never written: the cancel stopped the pieces not yet started.
  EXPECT_EQ(dest[n - 1], std::byte{0});
  // Destroying a pending transfer waits for its running piece and returns.
  auto tr2 = t->PostReads(ops).value();
  tr2.reset();
}

TEST(ShmTransportTest, SmallBatchIsCopiedInline) {
  auto t = MakeShm();
  auto buf = ShmBuffer::Create(256).value();
  Fill(buf.data(), 256, 5);
  auto remote = t->Import(t->RegisterMemory(buf.region()).value().descriptor).value();
  std::vector<std::byte> dest(256);
  std::vector<ReadOp> ops = {{remote, 0, dest.data(), 256}};
  auto tr = t->PostReads(ops).value();
  EXPECT_EQ(tr->Poll(), TransferState::kDone);  // no wait needed
  EXPECT_EQ(std::memcmp(dest.data(), buf.data(), 256), 0);
}

TEST(ShmTransportTest, ManyBuffersShareNothingAndOtherTransportsCannotDeregister) {
  auto a = MakeShm();
  auto b = MakeShm();
  std::vector<ShmBuffer> bufs;
  std::vector<Registration> regs;
  for (int i = 0; i < 20; ++i) {
    bufs.push_back(ShmBuffer::Create(1000 + i).value());
    Fill(bufs.back().data(), bufs.back().size(), 100 + i);
    regs.push_back(a->RegisterMemory(bufs.back().region()).value());
  }
  EXPECT_EQ(b->Deregister(regs[0].id).code(), StatusCode::kNotFound);
  for (int i = 0; i < 20; ++i) {
    auto remote = b->Import(regs[i].descriptor).value();
    EXPECT_EQ(remote.length, 1000u + i);
    std::vector<std::byte> dest(remote.length);
    std::vector<ReadOp> ops = {{remote, 0, dest.data(), dest.size()}};
    ASSERT_TRUE(b->PostReads(ops).value()->Wait(kFar).ok());
    EXPECT_EQ(std::memcmp(dest.data(), bufs[i].data(), dest.size()), 0) << i;
  }
}

}  // namespace
}  // namespace rc::transport
