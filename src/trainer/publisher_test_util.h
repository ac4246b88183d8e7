// Test helpers shared by the publisher's unit tests (publisher_test.cc, publisher_delta_test.cc):
// a fixture with a memory directory on a manual clock and a local transport, and a read of a
// published region through the transport the way a rollout engine reads it.
//
// Thread safety: test-only, one test thread.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "rolloutcore/base/clock.h"
#include "rolloutcore/directory/memory_store.h"
#include "rolloutcore/transport/local.h"

namespace rc::trainer::testing {

class PublisherFixture : public ::testing::Test {
 protected:
  void SetUp() override {
    store_ = directory::NewMemoryStore(&clock_);
    auto t = transport::CreateLocalTransport();
    ASSERT_TRUE(t.ok());
    transport_ = std::move(t).value();
  }
  ManualClock clock_;
  std::unique_ptr<directory::DirectoryStore> store_;
  std::unique_ptr<transport::Transport> transport_;
};

// `bytes` bytes at `offset` of the region `descriptor` names, read with `t` (empty, with a test
// failure recorded, when the import, the read or the release fails).
template <typename Byte = std::byte>
std::vector<Byte> ReadRemote(transport::Transport& t, const std::string& descriptor, uint64_t offset, uint64_t bytes) {
  static_assert(sizeof(Byte) == 1);
  auto remote = t.Import(descriptor);
  EXPECT_TRUE(remote.ok()) << remote.status().ToString();
  if (!remote.ok()) return {};
  std::vector<Byte> out(bytes);
  transport::ReadOp op{*remote, offset, out.data(), bytes};
  auto transfer = t.PostReads(std::span<const transport::ReadOp>(&op, 1));
  EXPECT_TRUE(transfer.ok()) << transfer.status().ToString();
  if (!transfer.ok()) return {};
  const Status s = (*transfer)->Wait(t.clock().NowNs() + 5'000'000'000);
  EXPECT_TRUE(s.ok()) << s.ToString();
  EXPECT_TRUE(t.ReleaseRemote(*remote).ok());
  return out;
}

}  // namespace rc::trainer::testing
