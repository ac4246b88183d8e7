// The Transport conformance suite: one set of tests for the promises transport.h makes, which
// every registered backend must keep (after llama.cpp's test-backend-ops and the directory's
// store_conformance.h). Instantiated by tests/transport/transport_conformance_test.cc for local,
// shm and ucx (normal build, label unit) and by tests/gpu/gpu_transport_conformance_test.cc for
// cuda_ipc and nccl (GPU build, label gpu).
//
// A TransportEnv supplies an owner transport (registers), a reader transport (imports and reads;
// may be the same object), memory of the kind the backend moves (host, ShmBuffer or device) that
// the test writes and reads back, and optionally the descriptor of an owner process that has died.
// The owner may live in another process: the ucx env's owner() forwards RegisterMemory and
// Deregister to the ucx transport of a child process that maps the env's source memory, so host
// memory registered through owner() comes from AllocateSource.
//
// What each case checks (all against real backends; the owner in the env's process or a child):
//   ReportsItsRegistryEntry         name() is the registry's, unsupported memory kinds are Unimplemented
//   ScatteredReadsAreByteIdentical  many reads of two regions (zero-length, region end, overlapping)
//                                   land byte for byte; bytes() is the batch total; Poll/status agree
//   SubRangeRegistrationReadsFromItsStart  a registered sub-range imports with its own length and
//                                   offset 0 is its first byte
//   MalformedBatchIsRefusedBeforeAnyByteMoves  out-of-range / overflowing / null-destination reads
//                                   fail (InvalidArgument) and no destination of the batch is written
//   ReadOfUnknownRemoteFails        a RemoteMemory this transport never imported is not read
//   WaitNeverBlocksPastTheDeadline  Wait with a passed deadline returns at once (OK or DeadlineExceeded
//                                   while pending), a later Wait completes the bytes
//   CancelEndsAbortedOrDone         Cancel then Wait gives OK (already done) or Aborted, stable in
//                                   Poll/status; Cancel of a done transfer changes nothing
//   DestroyedTransferWritesNothingAfterwards  nothing writes a destination once ~Transfer returned
//   ReimportAndReleaseKeepOtherImports  the same descriptor imported twice: releasing one leaves the
//                                   other readable; a re-import after release reads the same bytes
//   DeregisteredRegionIsNotRead     after Deregister, a re-import fails and reads fail (except where
//                                   the backend documents otherwise: ucx over tcp/shm); a second
//                                   Deregister is NotFound
//   MalformedDescriptorIsInvalidArgument  garbage, another backend's and a truncated descriptor
//   DeadOwnerIsReportedUnavailable  a descriptor whose owner process exited: Import (or the read) ends
//                                   Unavailable/NotFound, never hangs (needs env support)
//   ConcurrentPostsFromManyThreads  four threads post and wait at once; every byte lands
//
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "rolloutcore/transport/transport.h"
#include "rolloutcore/transport/registry.h"
#include "transport/descriptor_test_util.h"

namespace rc::transport::testing {

// Memory a test reads from (registered by the owner) or reads into (a destination).
class TestBuffer {
 public:
  virtual ~TestBuffer() = default;
  // The whole buffer as a region of the backend's memory kind.
  virtual MemoryRegion region() const = 0;
  virtual Status Write(uint64_t offset, const void* src, uint64_t n) = 0;
  virtual Status Read(uint64_t offset, void* dst, uint64_t n) const = 0;
  std::byte* data() const { return static_cast<std::byte*>(const_cast<void*>(region().addr)); }
  uint64_t size() const { return region().length; }
  MemoryRegion sub_region(uint64_t offset, uint64_t length) const {
    MemoryRegion r = region();
    r.addr = data() + offset;
    r.length = length;
    return r;
  }
  std::vector<std::byte> Contents() const {
    std::vector<std::byte> out(size());
    EXPECT_TRUE(Read(0, out.data(), out.size()).ok());
    return out;
  }
};

class TransportEnv {
 public:
  virtual ~TransportEnv() = default;
  virtual Transport& owner() = 0;
  virtual Transport& reader() = 0;
  // Zero-filled memory of `bytes` that reader() can read into (a destination).
  virtual Result<std::unique_ptr<TestBuffer>> Allocate(uint64_t bytes) = 0;
  // Zero-filled memory of `bytes` that owner() can register (a source); by default Allocate's.
  virtual Result<std::unique_ptr<TestBuffer>> AllocateSource(uint64_t bytes) { return Allocate(bytes); }
  // The descriptor of a region (at least 4096 bytes) whose owner process has exited and been
  // reaped; Unimplemented where the env cannot make one (the case then skips).
  virtual Result<std::string> DeadOwnerDescriptor() { return Unimplemented("no dead-owner support in this env"); }
  // False where the backend documents that reads of a deregistered region may still succeed.
  virtual bool deregistration_fails_reads() const { return true; }
};

struct TransportParam {
  std::string name;  // the backend's registry name
  // Returns the env, or nullptr with *skip set to why it cannot run here.
  std::function<std::unique_ptr<TransportEnv>(std::string* skip)> make;
};

inline void PrintTo(const TransportParam& param, std::ostream* os) { *os << param.name; }
inline std::string ParamName(const ::testing::TestParamInfo<TransportParam>& info) { return info.param.name; }

inline std::vector<std::byte> PatternBytes(uint64_t n, uint64_t seed) {
  std::vector<std::byte> out(n);
  std::mt19937_64 rng(seed);
  for (uint64_t i = 0; i < n; i += 8) {
    const uint64_t v = rng();
    std::memcpy(out.data() + i, &v, std::min<uint64_t>(8, n - i));
  }
  return out;
}

class TransportConformanceTest : public ::testing::TestWithParam<TransportParam> {
 protected:
  static constexpr int64_t kFar = INT64_MAX;

  void SetUp() override {
    std::string skip;
    env_ = GetParam().make(&skip);
    if (!env_) GTEST_SKIP() << skip;
  }

  Transport& owner() { return env_->owner(); }
  Transport& reader() { return env_->reader(); }

  std::unique_ptr<TestBuffer> Alloc(uint64_t bytes) {
    auto b = env_->Allocate(bytes);
    EXPECT_TRUE(b.ok()) << b.status().ToString();
    return b.ok() ? std::move(b).value() : nullptr;
  }

  std::unique_ptr<TestBuffer> AllocSource(uint64_t bytes) {
    auto b = env_->AllocateSource(bytes);
    EXPECT_TRUE(b.ok()) << b.status().ToString();
    return b.ok() ? std::move(b).value() : nullptr;
  }

  // A registered source of `bytes` filled with PatternBytes(bytes, seed).
  struct Source {
    std::unique_ptr<TestBuffer> buffer;
    Registration registration;
    std::vector<std::byte> contents;
  };
  Source MakeSource(uint64_t bytes, uint64_t seed) {
    Source s;
    s.buffer = AllocSource(bytes);
    if (!s.buffer) return s;
    s.contents = PatternBytes(bytes, seed);
    EXPECT_TRUE(s.buffer->Write(0, s.contents.data(), bytes).ok());
    auto reg = owner().RegisterMemory(s.buffer->region());
    EXPECT_TRUE(reg.ok()) << reg.status().ToString();
    if (reg.ok()) s.registration = *reg;
    return s;
  }

  // A 32 MiB source, imported, and a destination for all of it: a transfer long enough to be
  // pending for a while on asynchronous backends.
  struct BigRead {
    Source source;
    RemoteMemory remote;
    std::unique_ptr<TestBuffer> dest;
    ReadOp op() const { return ReadOp{remote, 0, dest->data(), remote.length}; }
  };
  BigRead MakeBigRead(uint64_t seed) {
    BigRead b;
    b.source = MakeSource(32 << 20, seed);
    if (!b.source.buffer) return b;
    b.remote = MustImport(b.source.registration.descriptor);
    b.dest = Alloc(32 << 20);
    return b;
  }

  RemoteMemory MustImport(const std::string& descriptor) {
    auto r = reader().Import(descriptor);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    return r.ok() ? *r : RemoteMemory{};
  }

  // Posts `ops` and waits far; the status of the whole thing (PostReads error or Wait result).
  Status ReadAll(std::span<const ReadOp> ops) {
    auto t = reader().PostReads(ops);
    if (!t.ok()) return t.status();
    return (*t)->Wait(kFar);
  }

  std::unique_ptr<TransportEnv> env_;
};

TEST_P(TransportConformanceTest, ReportsItsRegistryEntry) {
  EXPECT_EQ(reader().name(), GetParam().name);
  bool listed = false;
  for (const BackendEntry& b : RegisteredBackends()) listed |= b.name == GetParam().name;
  EXPECT_TRUE(listed) << GetParam().name << " is not in RegisteredBackends()";
  const Capabilities c = reader().capabilities();
  EXPECT_TRUE(c.host_memory || c.device_memory);
  std::vector<std::byte> host(64);
  if (!c.host_memory) {
    EXPECT_EQ(owner().RegisterMemory({host.data(), host.size(), MemoryKind::kHost, -1}).status().code(),
              StatusCode::kUnimplemented);
  }
  if (!c.device_memory) {
    EXPECT_EQ(owner().RegisterMemory({host.data(), host.size(), MemoryKind::kDevice, 0}).status().code(),
              StatusCode::kUnimplemented);
  }
}

TEST_P(TransportConformanceTest, ScatteredReadsAreByteIdentical) {
  Source a = MakeSource(1 << 20, 1);
  Source b = MakeSource(64 << 10, 2);
  ASSERT_TRUE(a.buffer && b.buffer);
  const RemoteMemory ra = MustImport(a.registration.descriptor);
  const RemoteMemory rb = MustImport(b.registration.descriptor);
  EXPECT_EQ(ra.length, a.contents.size());
  EXPECT_EQ(rb.length, b.contents.size());
  auto dest = Alloc(2 << 20);
  ASSERT_TRUE(dest);
  struct Expect {
    uint64_t dest_offset;
    const std::vector<std::byte>* src;
    uint64_t src_offset, length;
  };
  std::vector<ReadOp> ops;
  std::vector<Expect> expect;
  std::mt19937_64 rng(7);
  uint64_t cursor = 0, total = 0;
  auto add = [&](const RemoteMemory& r, const std::vector<std::byte>& src, uint64_t off, uint64_t len) {
    ops.push_back(ReadOp{r, off, dest->data() + cursor, len});
    expect.push_back({cursor, &src, off, len});
    cursor += (len + 63) / 64 * 64 + 64;
    total += len;
  };
  add(ra, a.contents, 0, 0);                      // zero-length
  add(ra, a.contents, a.contents.size() - 1, 1);  // the last byte
  add(rb, b.contents, 0, b.contents.size());      // a whole region
  add(ra, a.contents, 4096, 8192);                // overlapping sources are fine
  add(ra, a.contents, 8000, 4096);
  for (int i = 0; i < 48; ++i) {
    const bool from_a = i % 3 != 0;
    const auto& src = from_a ? a.contents : b.contents;
    const uint64_t len = 1 + rng() % 9000;
    const uint64_t off = rng() % (src.size() - len);
    add(from_a ? ra : rb, src, off, len);
  }
  ASSERT_LE(cursor, dest->size());
  auto t = reader().PostReads(ops);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ((*t)->bytes(), total);
  ASSERT_TRUE((*t)->Wait(kFar).ok()) << (*t)->status().ToString();
  EXPECT_EQ((*t)->Poll(), TransferState::kDone);
  EXPECT_TRUE((*t)->status().ok());
  const std::vector<std::byte> got = dest->Contents();
  for (size_t i = 0; i < expect.size(); ++i) {
    const Expect& e = expect[i];
    ASSERT_EQ(std::memcmp(got.data() + e.dest_offset, e.src->data() + e.src_offset, e.length), 0)
        << "read " << i << " (" << e.length << " bytes from offset " << e.src_offset << ") differs";
    // The gap after each read stays untouched.
    for (uint64_t k = e.dest_offset + e.length; k < e.dest_offset + (e.length + 63) / 64 * 64 + 64; ++k) {
      ASSERT_EQ(got[k], std::byte{0}) << "byte " << k << " after read " << i << " was written";
    }
  }
}

TEST_P(TransportConformanceTest, SubRangeRegistrationReadsFromItsStart) {
  auto buf = AllocSource(1 << 16);
  ASSERT_TRUE(buf);
  const std::vector<std::byte> bytes = PatternBytes(buf->size(), 3);
  ASSERT_TRUE(buf->Write(0, bytes.data(), bytes.size()).ok());
  auto reg = owner().RegisterMemory(buf->sub_region(4096, 12288));
  ASSERT_TRUE(reg.ok()) << reg.status().ToString();
  const RemoteMemory r = MustImport(reg->descriptor);
  EXPECT_EQ(r.length, 12288u);
  auto dest = Alloc(12288);
  ASSERT_TRUE(dest);
  const ReadOp op{r, 0, dest->data(), 12288};
  ASSERT_TRUE(ReadAll({&op, 1}).ok());
  const std::vector<std::byte> got = dest->Contents();
  EXPECT_EQ(std::memcmp(got.data(), bytes.data() + 4096, 12288), 0);
  // One byte past the sub-range is outside it, although the buffer goes on.
  const ReadOp past{r, 12288 - 8, dest->data(), 9};
  EXPECT_FALSE(ReadAll({&past, 1}).ok());
}

TEST_P(TransportConformanceTest, MalformedBatchIsRefusedBeforeAnyByteMoves) {
  Source s = MakeSource(1 << 16, 4);
  ASSERT_TRUE(s.buffer);
  const RemoteMemory r = MustImport(s.registration.descriptor);
  auto dest = Alloc(1 << 16);
  ASSERT_TRUE(dest);
  struct Case {
    const char* what;
    ReadOp bad;
  };
  const std::vector<Case> cases = {
      {"past the end", ReadOp{r, r.length - 16, dest->data() + 8192, 17}},
      {"offset past the end", ReadOp{r, r.length + 1, dest->data() + 8192, 0}},
      {"offset + length overflows", ReadOp{r, UINT64_MAX - 4, dest->data() + 8192, 16}},
      {"null destination", ReadOp{r, 0, nullptr, 16}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    // A valid read first: it must not happen either (the batch is checked before anything moves).
    const std::vector<ReadOp> ops = {ReadOp{r, 0, dest->data(), 4096}, c.bad};
    auto t = reader().PostReads(ops);
    Status s2 = t.ok() ? (*t)->Wait(kFar) : t.status();
    EXPECT_EQ(s2.code(), StatusCode::kInvalidArgument) << s2.ToString();
    EXPECT_NE(s2.message().find("read 1 of batch"), std::string::npos) << s2.message();
    const std::vector<std::byte> got = dest->Contents();
    for (uint64_t k = 0; k < 4096; ++k) ASSERT_EQ(got[k], std::byte{0}) << "byte " << k << " was written";
  }
}

TEST_P(TransportConformanceTest, ReadOfUnknownRemoteFails) {
  Source s = MakeSource(4096, 5);
  ASSERT_TRUE(s.buffer);
  const RemoteMemory r = MustImport(s.registration.descriptor);
  auto dest = Alloc(4096);
  ASSERT_TRUE(dest);
  const ReadOp op{RemoteMemory{r.id + 1000, r.length}, 0, dest->data(), 64};
  EXPECT_FALSE(ReadAll({&op, 1}).ok());
  const std::vector<std::byte> got = dest->Contents();
  for (uint64_t k = 0; k < 64; ++k) ASSERT_EQ(got[k], std::byte{0});
}

TEST_P(TransportConformanceTest, WaitNeverBlocksPastTheDeadline) {
  BigRead b = MakeBigRead(6);
  ASSERT_TRUE(b.source.buffer && b.dest);
  const ReadOp op = b.op();
  auto t = reader().PostReads({&op, 1});
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  const auto start = std::chrono::steady_clock::now();
  const Status early = (*t)->Wait(reader().clock().NowNs() - 1'000'000'000);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(500));
  if (!early.ok()) {
    EXPECT_EQ(early.code(), StatusCode::kDeadlineExceeded) << early.ToString();
  }
  ASSERT_TRUE((*t)->Wait(kFar).ok()) << (*t)->status().ToString();
  EXPECT_TRUE(b.dest->Contents() == b.source.contents);
}

TEST_P(TransportConformanceTest, CancelEndsAbortedOrDone) {
  BigRead b = MakeBigRead(7);
  ASSERT_TRUE(b.source.buffer && b.dest);
  const ReadOp op = b.op();
  auto t = reader().PostReads({&op, 1});
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  (*t)->Cancel();
  const Status end = (*t)->Wait(kFar);
  EXPECT_TRUE(end.ok() || end.code() == StatusCode::kAborted) << end.ToString();
  EXPECT_EQ((*t)->Poll(), end.ok() ? TransferState::kDone : TransferState::kFailed);
  EXPECT_EQ((*t)->status().code(), end.code());
  if (end.ok()) {
    EXPECT_TRUE(b.dest->Contents() == b.source.contents);
  }
  // A completed transfer stays completed. (Imported afresh: a cancel may have made `r` unusable,
  // as nccl.h documents: it aborts the owner's communicator.)
  const RemoteMemory r2 = MustImport(b.source.registration.descriptor);
  auto dest2 = Alloc(4096);
  ASSERT_TRUE(dest2);
  const ReadOp small{r2, 0, dest2->data(), 4096};
  auto t2 = reader().PostReads({&small, 1});
  ASSERT_TRUE(t2.ok());
  ASSERT_TRUE((*t2)->Wait(kFar).ok());
  (*t2)->Cancel();
  EXPECT_EQ((*t2)->Poll(), TransferState::kDone);
  EXPECT_TRUE((*t2)->status().ok());
}

TEST_P(TransportConformanceTest, DestroyedTransferWritesNothingAfterwards) {
  BigRead b = MakeBigRead(8);
  ASSERT_TRUE(b.source.buffer && b.dest);
  {
    const ReadOp op = b.op();
    auto t = reader().PostReads({&op, 1});
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    (*t)->Cancel();
  }  // destroyed while (possibly) pending
  const std::vector<std::byte> sentinel(b.dest->size(), std::byte{0xee});
  ASSERT_TRUE(b.dest->Write(0, sentinel.data(), sentinel.size()).ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  EXPECT_TRUE(b.dest->Contents() == sentinel) << "a destroyed transfer still wrote its destination";
}

TEST_P(TransportConformanceTest, ReimportAndReleaseKeepOtherImports) {
  Source s = MakeSource(1 << 16, 9);
  ASSERT_TRUE(s.buffer);
  const RemoteMemory first = MustImport(s.registration.descriptor);
  const RemoteMemory second = MustImport(s.registration.descriptor);
  EXPECT_EQ(first.length, second.length);
  ASSERT_TRUE(reader().ReleaseRemote(first).ok());
  auto dest = Alloc(1 << 16);
  ASSERT_TRUE(dest);
  const ReadOp op{second, 0, dest->data(), second.length};
  ASSERT_TRUE(ReadAll({&op, 1}).ok());
  EXPECT_TRUE(dest->Contents() == s.contents);
  ASSERT_TRUE(reader().ReleaseRemote(second).ok());
  // After every import of it was released, the descriptor imports (and reads) again.
  const RemoteMemory again = MustImport(s.registration.descriptor);
  const std::vector<std::byte> zeros(dest->size(), std::byte{0});
  ASSERT_TRUE(dest->Write(0, zeros.data(), zeros.size()).ok());
  const ReadOp op2{again, 0, dest->data(), again.length};
  ASSERT_TRUE(ReadAll({&op2, 1}).ok());
  EXPECT_TRUE(dest->Contents() == s.contents);
  EXPECT_TRUE(reader().ReleaseRemote(again).ok());
}

TEST_P(TransportConformanceTest, DeregisteredRegionIsNotRead) {
  Source s = MakeSource(1 << 16, 10);
  ASSERT_TRUE(s.buffer);
  const RemoteMemory r = MustImport(s.registration.descriptor);
  ASSERT_TRUE(owner().Deregister(s.registration.id).ok());
  EXPECT_EQ(owner().Deregister(s.registration.id).code(), StatusCode::kNotFound);
  auto again = reader().Import(s.registration.descriptor);
  if (env_->deregistration_fails_reads()) {
    EXPECT_FALSE(again.ok()) << "a deregistered region imported again";
    if (!again.ok()) {
      EXPECT_TRUE(again.status().code() == StatusCode::kNotFound || again.status().code() == StatusCode::kUnavailable)
          << again.status().ToString();
    }
    auto dest = Alloc(1 << 16);
    ASSERT_TRUE(dest);
    const ReadOp op{r, 0, dest->data(), r.length};
    EXPECT_FALSE(ReadAll({&op, 1}).ok()) << "a deregistered region was read";
  }
  if (again.ok()) (void)reader().ReleaseRemote(*again);
}

TEST_P(TransportConformanceTest, MalformedDescriptorIsInvalidArgument) {
  Source s = MakeSource(4096, 11);
  ASSERT_TRUE(s.buffer);
  const std::string& d = s.registration.descriptor;
  const std::string other = GetParam().name == "shm" ? "ucx:v1:host=h:pid=1" : "shm:v1:pid=1:fd=3";
  for (const std::string& text :
       {std::string("garbage"), std::string(""), other, d.substr(0, d.size() / 2) + "::", d + ":" + "zz=1"}) {
    auto r = reader().Import(text);
    ASSERT_FALSE(r.ok()) << text;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << text << ": " << r.status().ToString();
  }
}

TEST_P(TransportConformanceTest, DeadOwnerIsReportedUnavailable) {
  auto desc = env_->DeadOwnerDescriptor();
  if (desc.status().code() == StatusCode::kUnimplemented) GTEST_SKIP() << desc.status().message();
  ASSERT_TRUE(desc.ok()) << desc.status().ToString();
  const auto start = std::chrono::steady_clock::now();
  auto r = reader().Import(*desc);
  Status s = r.status();
  if (r.ok()) {
    // Imported before the death was noticed: the read must then report it.
    auto dest = Alloc(4096);
    ASSERT_TRUE(dest);
    const ReadOp op{*r, 0, dest->data(), std::min<uint64_t>(4096, r->length)};
    auto t = reader().PostReads({&op, 1});
    s = t.ok() ? (*t)->Wait(reader().clock().NowNs() + 10'000'000'000) : t.status();
    (void)reader().ReleaseRemote(*r);
  }
  EXPECT_TRUE(s.code() == StatusCode::kUnavailable || s.code() == StatusCode::kNotFound) << s.ToString();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
}

TEST_P(TransportConformanceTest, ConcurrentPostsFromManyThreads) {
  Source s = MakeSource(4 << 20, 12);
  ASSERT_TRUE(s.buffer);
  const RemoteMemory r = MustImport(s.registration.descriptor);
  constexpr int kThreads = 4;
  std::vector<std::unique_ptr<TestBuffer>> dests;
  for (int i = 0; i < kThreads; ++i) {
    dests.push_back(Alloc(s.contents.size()));
    ASSERT_TRUE(dests.back());
  }
  std::vector<Status> results(kThreads);
  std::vector<std::thread> threads;
  threads.reserve(kThreads);
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&, i] {
      // Eight reads of 512 KiB each, in an order that differs per thread.
      std::vector<ReadOp> ops;
      for (int k = 0; k < 8; ++k) {
        const uint64_t piece = static_cast<uint64_t>((k + i) % 8) * (512 << 10);
        ops.push_back(ReadOp{r, piece, dests[static_cast<size_t>(i)]->data() + piece, 512 << 10});
      }
      auto t = reader().PostReads(ops);
      results[static_cast<size_t>(i)] = t.ok() ? (*t)->Wait(kFar) : t.status();
    });
  }
  for (auto& t : threads) t.join();
  for (int i = 0; i < kThreads; ++i) {
    EXPECT_TRUE(results[static_cast<size_t>(i)].ok()) << results[static_cast<size_t>(i)].ToString();
    EXPECT_TRUE(dests[static_cast<size_t>(i)]->Contents() == s.contents) << "thread " << i;
  }
}

}  // namespace rc::transport::testing
