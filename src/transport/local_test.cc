#include "rolloutcore/transport/local.h"
#include "rolloutcore/transport/registry.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <numeric>
#include <vector>

namespace rc::transport {
namespace {

using ::testing::HasSubstr;

TEST(RegistryTest, ListsLocalAndRefusesUnknown) {
  auto backends = RegisteredBackends();
  ASSERT_FALSE(backends.empty());
  EXPECT_EQ(backends[0].name, "local");
  auto t = CreateTransport("local");
  ASSERT_TRUE(t.ok());
  EXPECT_EQ((*t)->name(), "local");
  EXPECT_TRUE((*t)->capabilities().host_memory);
  EXPECT_FALSE((*t)->capabilities().cross_process);
  auto u = CreateTransport("carrier-pigeon");
  EXPECT_EQ(u.status().code(), StatusCode::kNotFound);
  EXPECT_THAT(u.status().message(), HasSubstr("available: local"));
}

TEST(LocalTransportTest, ReadsAcrossInstancesOfOneProcess) {
  auto owner = std::move(CreateLocalTransport()).value();
  auto reader = std::move(CreateLocalTransport()).value();
  std::vector<uint8_t> src(64);
  std::iota(src.begin(), src.end(), 0);
  auto reg = owner->RegisterMemory({src.data(), src.size()});
  ASSERT_TRUE(reg.ok());
  EXPECT_THAT(reg->descriptor, HasSubstr("local:v1:"));
  auto remote = reader->Import(reg->descriptor);
  ASSERT_TRUE(remote.ok()) << remote.status().ToString();
  EXPECT_EQ(remote->length, 64u);
  std::vector<uint8_t> dst(16, 0xff);
  const ReadOp ops[] = {{*remote, 10, dst.data(), 4}, {*remote, 60, dst.data() + 8, 4}};
  auto t = reader->PostReads(ops);
  ASSERT_TRUE(t.ok());
  EXPECT_EQ((*t)->Poll(), TransferState::kDone);
  EXPECT_TRUE((*t)->Wait(reader->clock().NowNs()).ok());
  EXPECT_EQ((*t)->bytes(), 8u);
  EXPECT_EQ(dst, (std::vector<uint8_t>{10, 11, 12, 13, 0xff, 0xff, 0xff, 0xff, 60, 61, 62, 63, 0xff, 0xff, 0xff, 0xff}));
  EXPECT_TRUE(reader->ReleaseRemote(*remote).ok());
  EXPECT_TRUE(owner->Deregister(reg->id).ok());
  EXPECT_EQ(owner->Deregister(reg->id).code(), StatusCode::kNotFound);
}

TEST(LocalTransportTest, BadBatchFailsBeforeAnyByteMoves) {
  auto t = std::move(CreateLocalTransport()).value();
  std::vector<uint8_t> src(32, 7);
  auto reg = t->RegisterMemory({src.data(), src.size()});
  auto remote = t->Import(reg->descriptor);
  ASSERT_TRUE(remote.ok());
  std::vector<uint8_t> dst(8, 0);
  const ReadOp ops[] = {{*remote, 0, dst.data(), 4}, {*remote, 30, dst.data() + 4, 4}};
  auto tr = t->PostReads(ops);
  ASSERT_TRUE(tr.ok());
  EXPECT_EQ((*tr)->Poll(), TransferState::kFailed);
  EXPECT_EQ((*tr)->status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT((*tr)->status().message(), HasSubstr("bytes 30..34 outside local region"));
  EXPECT_EQ(dst, std::vector<uint8_t>(8, 0));
  // After deregistration reads fail instead of touching freed memory.
  ASSERT_TRUE(t->Deregister(reg->id).ok());
  const ReadOp one[] = {{*remote, 0, dst.data(), 4}};
  auto after = t->PostReads(one);
  ASSERT_TRUE(after.ok());
  EXPECT_EQ((*after)->Wait(0).code(), StatusCode::kUnavailable);
  EXPECT_EQ(t->Import(reg->descriptor).status().code(), StatusCode::kNotFound);
}

TEST(LocalTransportTest, RejectsForeignAndMalformedDescriptors) {
  auto t = std::move(CreateLocalTransport()).value();
  EXPECT_EQ(t->Import("local:v1:1:1:8").status().code(), StatusCode::kUnavailable);  // pid 1 is not us
  EXPECT_EQ(t->Import("ucx:abc").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(t->Import("local:v1:12:x:8").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(t->Import("local:v1:12:3:8:9").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(t->RegisterMemory({nullptr, 0, MemoryKind::kDevice, 0}).status().code(), StatusCode::kUnimplemented);
}

}  // namespace
}  // namespace rc::transport
