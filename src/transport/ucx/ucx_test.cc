// In-process tests of the ucx transport: descriptor parsing, and an owner and a reader transport
// in one process talking through UCX (whatever UCX_TLS allows). Cross-process and fault tests are
// in tests/transport/.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <random>
#include <vector>

#include "rolloutcore/transport/ucx.h"
#include "transport/ucx/ucx_descriptor.h"
#include "transport/descriptor_test_util.h"

namespace rc::transport {
namespace {

using ucx_internal::ParseUcxDescriptor;
using ucx_internal::UcxDescriptor;

constexpr int64_t kFar = INT64_MAX;

std::unique_ptr<Transport> MakeUcx() {
  auto r = CreateUcxTransport();
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return r.ok() ? std::move(r).value() : nullptr;
}

TEST(UcxDescriptorTest, RoundTripsAndHex) {
  UcxDescriptor d;
  d.host = "node-1.example";
  d.pid = 321;
  d.id = 5;
  d.address = 0x7f00deadbeef;
  d.length = 1 << 20;
  d.worker_address = std::string("\x00\x01\xfe\xff", 4);
  d.rkey = "rk";
  const std::string text = ucx_internal::FormatUcxDescriptor(d);
  EXPECT_NE(text.find("worker=0001feff"), std::string::npos) << text;
  auto p = ParseUcxDescriptor(text);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->host, d.host);
  EXPECT_EQ(p->pid, 321);
  EXPECT_EQ(p->id, 5u);
  EXPECT_EQ(p->address, d.address);
  EXPECT_EQ(p->length, d.length);
  EXPECT_EQ(p->worker_address, d.worker_address);
  EXPECT_EQ(p->rkey, "rk");
}

TEST(UcxDescriptorTest, MalformedNamesTheField) {
  const std::string good = "ucx:v1:host=h:pid=1:id=2:addr=ff:len=8:worker=00ab:rkey=0102";
  ASSERT_TRUE(ParseUcxDescriptor(good).ok());
  const std::vector<testing::ParseErrorCase> cases = {
      {"shm:v1:pid=1", "does not start with 'ucx:v1:'"},
      {"ucx:v1:host=h:pid=1:id=2:addr=ff:len=8:worker=00ab", "missing field 'rkey'"},
      {"ucx:v1:host=h:pid=1:id=2:addr=fg:len=8:worker=00ab:rkey=0102", "field 'addr': 'fg' is not a hex"},
      {"ucx:v1:host=h:pid=1:id=2:addr=ff:len=-8:worker=00ab:rkey=0102", "field 'len': '-8' is not a decimal"},
      {"ucx:v1:host=h:pid=1:id=2:addr=ff:len=8:worker=0ab:rkey=0102", "field 'worker'"},
      {"ucx:v1:host=h:pid=1:id=2:addr=ff:len=8:worker=00ab:rkey=zz", "field 'rkey'"},
      {"ucx:v1:host=h:pid=1:id=2:addr=ff:len=8:worker=00ab:rkey=", "field 'rkey'"},
      {"ucx:v1:host=:pid=1:id=2:addr=ff:len=8:worker=00ab:rkey=0102", "field 'host'"},
      {"ucx:v1:host=h:pid=0:id=2:addr=ff:len=8:worker=00ab:rkey=0102", "field 'pid'"},
      {"ucx:v1:host=h:pid=1:id=2:addr=ffffffffffffffff:len=8:worker=00ab:rkey=0102", "overflow"},
      {"ucx:v1:host=h:pid=1:id=2:addr=ff:len=8:worker=00ab:rkey=0102:extra=1", "unknown field 'extra'"},
      {"ucx:v1:host=h:pid=1:id=2:id=2:addr=ff:len=8:worker=00ab:rkey=0102", "field 'id' appears twice"},
  };
  testing::ExpectParseErrors([](const std::string& text) { return ParseUcxDescriptor(text); }, cases);
}

TEST(UcxTransportTest, CapabilitiesAndRegistrationErrors) {
  auto t = MakeUcx();
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->name(), "ucx");
  const Capabilities c = t->capabilities();
  EXPECT_TRUE(c.host_memory && c.cross_process && c.cross_host && c.asynchronous);
  EXPECT_FALSE(c.device_memory);
  std::vector<std::byte> buf(16);
  EXPECT_EQ(t->RegisterMemory(MemoryRegion{buf.data(), 0}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(t->RegisterMemory(MemoryRegion{nullptr, 16}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(t->RegisterMemory(MemoryRegion{buf.data(), 16, MemoryKind::kDevice, 0}).status().code(),
            StatusCode::kUnimplemented);
  EXPECT_EQ(t->Deregister(12345).code(), StatusCode::kNotFound);
  auto bad = t->Import("ucx:v1:host=h:pid=1:id=2:addr=ff:len=8:worker=00ab");
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("missing field 'rkey'"), std::string::npos);
}

TEST(UcxTransportTest, ScatteredReadsBetweenTwoTransportsInOneProcess) {
  auto owner = MakeUcx();
  auto reader = MakeUcx();
  ASSERT_TRUE(owner && reader);
  const uint64_t n = (3 << 20) + 17;
  std::vector<std::byte> src(n);
  std::mt19937_64 rng(5);
  for (auto& b : src) b = static_cast<std::byte>(rng());
  auto reg = owner->RegisterMemory(MemoryRegion{src.data() + 1, n - 1});
  ASSERT_TRUE(reg.ok()) << reg.status().ToString();
  auto remote = reader->Import(reg->descriptor);
  ASSERT_TRUE(remote.ok()) << remote.status().ToString();
  EXPECT_EQ(remote->length, n - 1);
  std::vector<std::byte> dest(n, std::byte{0});
  std::vector<ReadOp> ops;
  uint64_t dpos = 3;
  for (int i = 0; i < 300; ++i) {
    const uint64_t len = i % 60 == 0 ? (rng() % (256 << 10)) + 1 : (rng() % 999) + 1;
    if (dpos + len > n) break;
    ops.push_back({*remote, rng() % (n - 1 - len), dest.data() + dpos, len});
    dpos += len + 1;
  }
  auto tr = reader->PostReads(ops);
  ASSERT_TRUE(tr.ok()) << tr.status().ToString();
  Status s = (*tr)->Wait(reader->clock().NowNs() + 30'000'000'000);
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ((*tr)->Poll(), TransferState::kDone);
  for (const ReadOp& op : ops) {
    ASSERT_EQ(std::memcmp(op.dest, src.data() + 1 + op.source_offset, op.length), 0) << op.source_offset;
  }
  // Malformed batches are refused before anything is posted.
  std::vector<ReadOp> bad = {{*remote, n - 2, dest.data(), 2}};
  EXPECT_EQ(reader->PostReads(bad).status().code(), StatusCode::kInvalidArgument);
  std::vector<ReadOp> unknown = {{RemoteMemory{999, 4}, 0, dest.data(), 2}};
  EXPECT_EQ(reader->PostReads(unknown).status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(reader->ReleaseRemote(*remote).ok());
  EXPECT_EQ(reader->ReleaseRemote(*remote).code(), StatusCode::kNotFound);
  EXPECT_TRUE(owner->Deregister(reg->id).ok());
}

TEST(UcxTransportTest, ImportOfADeadOwnerOnThisHostIsUnavailable) {
  auto owner = MakeUcx();
  auto reader = MakeUcx();
  ASSERT_TRUE(owner && reader);
  std::vector<std::byte> src(64);
  auto reg = owner->RegisterMemory(MemoryRegion{src.data(), src.size()}).value();
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  ASSERT_GT(child, 0);
  int wstatus = 0;
  ASSERT_EQ(::waitpid(child, &wstatus, 0), child);
  auto d = ParseUcxDescriptor(reg.descriptor).value();
  d.pid = child;  // a process that no longer exists
  auto imported = reader->Import(ucx_internal::FormatUcxDescriptor(d));
  ASSERT_FALSE(imported.ok());
  EXPECT_EQ(imported.status().code(), StatusCode::kUnavailable) << imported.status().ToString();
  EXPECT_NE(imported.status().message().find("is gone"), std::string::npos);
}

TEST(UcxTransportTest, TransfersOutliveTheirTransport) {
  auto owner = MakeUcx();
  auto reader = MakeUcx();
  ASSERT_TRUE(owner && reader);
  std::vector<std::byte> src(1 << 20, std::byte{7});
  auto reg = owner->RegisterMemory(MemoryRegion{src.data(), src.size()}).value();
  auto remote = reader->Import(reg.descriptor).value();
  std::vector<std::byte> dest(src.size());
  std::vector<ReadOp> ops = {{remote, 0, dest.data(), dest.size()}};
  auto tr = reader->PostReads(ops).value();
  ASSERT_TRUE(tr->Wait(kFar).ok());
  reader.reset();  // the transfer keeps the core alive; destroying it later is safe
  EXPECT_EQ(tr->Poll(), TransferState::kDone);
  tr.reset();
  EXPECT_EQ(dest[12345], std::byte{7});
}

}  // namespace
}  // namespace rc::transport
