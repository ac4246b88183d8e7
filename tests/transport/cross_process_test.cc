// Cross-process tests of the shm and ucx transports: a child (rc_transport_peer) allocates,
// fills and registers seeded regions; this process imports its descriptors and reads scattered
// batches, comparing every byte. Also: the same plan over local, shm and ucx gives byte-identical
// destinations.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "rolloutcore/transport/local.h"
#include "rolloutcore/transport/shm.h"
#include "transport/peer_data.h"
#include "transport/peer_process.h"
#include "transport/read_plan.h"
#include "transport/scoped_env.h"
#ifdef RC_HAVE_UCX
#include "rolloutcore/transport/ucx.h"
#endif

namespace rc::transport {
namespace {

using testing::ExpectPlanBytes;
using testing::MakeScatterPlan;
using testing::PeerProcess;
using testing::RunPlan;
using testing::ScopedEnv;

constexpr int64_t kFar = INT64_MAX;
const std::vector<uint64_t> kSizes = {(1 << 20) + 7, 5 << 20, 33, (2 << 20) - 1};

std::vector<RemoteMemory> ImportAll(Transport& t, const PeerProcess& peer) {
  std::vector<RemoteMemory> remotes;
  for (const std::string& d : peer.descriptors()) {
    auto r = t.Import(d);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    if (r.ok()) remotes.push_back(*r);
  }
  return remotes;
}

TEST(ShmCrossProcessTest, ScatteredBatchesMatchEveryByte) {
  auto peer = PeerProcess::Spawn("shm", 41, kSizes);
  ASSERT_TRUE(peer.ok()) << peer.status().ToString();
  ASSERT_EQ((*peer)->descriptors().size(), kSizes.size());
  auto t = CreateShmTransport({}, {.copy_threads = 2, .inline_bytes = 4096, .piece_bytes = 256 << 10}).value();
  const auto remotes = ImportAll(*t, **peer);
  ASSERT_EQ(remotes.size(), kSizes.size());
  for (size_t i = 0; i < kSizes.size(); ++i) EXPECT_EQ(remotes[i].length, kSizes[i]);
  const auto plan = MakeScatterPlan(kSizes, 1);
  const auto dest = RunPlan(*t, remotes, plan);
  ExpectPlanBytes(plan, dest, 41);
}

TEST(ShmCrossProcessTest, ImportedRegionsStayReadableAfterTheOwnerDiesButNewImportsFail) {
  auto peer = PeerProcess::Spawn("shm", 42, kSizes).value();
  auto t = CreateShmTransport().value();
  const auto remotes = ImportAll(*t, *peer);
  ASSERT_EQ(remotes.size(), kSizes.size());
  peer->KillAndReap();
  // Documented: our read-only mapping keeps the memory; the bytes are the owner's last ones.
  const auto plan = MakeScatterPlan(kSizes, 2, 50);
  const auto dest = RunPlan(*t, remotes, plan);
  ExpectPlanBytes(plan, dest, 42);
  // The explicit liveness check: a new import of the dead owner's descriptor is Unavailable.
  auto fresh = CreateShmTransport().value();
  auto imported = fresh->Import(peer->descriptors()[0]);
  ASSERT_FALSE(imported.ok());
  EXPECT_EQ(imported.status().code(), StatusCode::kUnavailable) << imported.status().ToString();
  EXPECT_NE(imported.status().message().find("is gone"), std::string::npos) << imported.status().message();
}

TEST(ShmCrossProcessTest, OwnerDeregistrationFailsReaderTransfers) {
  auto peer = PeerProcess::Spawn("shm", 43, {1 << 20, 4096}).value();
  auto t = CreateShmTransport().value();
  const auto remotes = ImportAll(*t, *peer);
  ASSERT_EQ(remotes.size(), 2u);
  std::vector<std::byte> dest(1 << 20);
  std::vector<ReadOp> ops = {{remotes[0], 0, dest.data(), dest.size()}};
  ASSERT_TRUE(t->PostReads(ops).value()->Wait(kFar).ok());
  ASSERT_EQ(peer->Command("DEREG 0"), "OK");
  Status s = t->PostReads(ops).value()->Wait(kFar);
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.ToString();
  EXPECT_NE(s.message().find("deregistered"), std::string::npos);
  // The other region is unaffected; the deregistered one cannot be imported again.
  std::vector<ReadOp> ops1 = {{remotes[1], 0, dest.data(), 4096}};
  EXPECT_TRUE(t->PostReads(ops1).value()->Wait(kFar).ok());
  EXPECT_EQ(t->Import(peer->descriptors()[0]).status().code(), StatusCode::kNotFound);
}

TEST(ShmCrossProcessTest, TamperedDescriptorsAreRefusedNamingTheProblem) {
  auto peer = PeerProcess::Spawn("shm", 44, {8192}).value();
  const std::string good = peer->descriptors()[0];
  auto t = CreateShmTransport().value();
  auto replace = [&](const std::string& key, const std::string& value) {
    const size_t at = good.find(":" + key + "=") + key.size() + 2;
    const size_t end = good.find(':', at);
    return good.substr(0, at) + value + (end == std::string::npos ? "" : good.substr(end));
  };
  // A different token: not the memfd the descriptor was made for (recycled fd or pid).
  auto r = t->Import(replace("tok", "0123456789abcdef"));
  EXPECT_EQ(r.status().code(), StatusCode::kUnavailable) << r.status().ToString();
  EXPECT_NE(r.status().message().find("is not the memfd"), std::string::npos) << r.status().message();
  // An fd the owner does not have.
  r = t->Import(replace("fd", "999"));
  EXPECT_EQ(r.status().code(), StatusCode::kUnavailable) << r.status().ToString();
  // A length beyond the memfd.
  r = t->Import(replace("len", "100000"));
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().ToString();
  // A slot outside the control block.
  r = t->Import(replace("slot", "70000"));
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().ToString();
  EXPECT_NE(r.status().message().find("field 'slot'"), std::string::npos);
  // Garbage in a field.
  r = t->Import(replace("off", "12x"));
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("field 'off'"), std::string::npos);
  // The untouched one works.
  EXPECT_TRUE(t->Import(good).ok());
}

#ifdef RC_HAVE_UCX
class UcxCrossProcessTest : public ::testing::TestWithParam<const char*> {};

TEST_P(UcxCrossProcessTest, ScatteredBatchesMatchEveryByte) {
  ScopedEnv tls("UCX_TLS", GetParam());
  auto peer = PeerProcess::Spawn("ucx", 51, kSizes, {std::string("UCX_TLS=") + GetParam()});
  ASSERT_TRUE(peer.ok()) << peer.status().ToString();
  auto t = CreateUcxTransport().value();
  const auto remotes = ImportAll(*t, **peer);
  ASSERT_EQ(remotes.size(), kSizes.size());
  const auto plan = MakeScatterPlan(kSizes, 3);
  const auto dest = RunPlan(*t, remotes, plan);
  ExpectPlanBytes(plan, dest, 51);
}

TEST_P(UcxCrossProcessTest, ImportOfADeadOwnerIsUnavailable) {
  ScopedEnv tls("UCX_TLS", GetParam());
  auto peer = PeerProcess::Spawn("ucx", 52, {4096}, {std::string("UCX_TLS=") + GetParam()}).value();
  peer->KillAndReap();
  auto t = CreateUcxTransport().value();
  auto r = t->Import(peer->descriptors()[0]);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kUnavailable) << r.status().ToString();
}

std::string TlsName(const ::testing::TestParamInfo<const char*>& p) { return p.param[0] == 't' ? "tcp" : "sm"; }
INSTANTIATE_TEST_SUITE_P(Tls, UcxCrossProcessTest, ::testing::Values("tcp,self", "sm,self"), TlsName);
#endif

// The same plan over every backend gives byte-identical destinations (and the right bytes).
TEST(CrossBackendConsistencyTest, LocalShmAndUcxGiveByteIdenticalDestinations) {
  const uint64_t seed = 61;
  const auto plan = MakeScatterPlan(kSizes, 4);
  std::vector<std::vector<std::byte>> results;
  std::vector<std::string> names;

  {  // local: this process owns the seeded regions.
    auto t = CreateLocalTransport().value();
    std::vector<std::vector<std::byte>> regions;
    std::vector<RemoteMemory> remotes;
    for (size_t r = 0; r < kSizes.size(); ++r) {
      regions.emplace_back(kSizes[r]);
      testing::FillPeerBytes(seed, r, 0, regions.back().data(), kSizes[r]);
      auto reg = t->RegisterMemory(MemoryRegion{regions.back().data(), kSizes[r]}).value();
      remotes.push_back(t->Import(reg.descriptor).value());
    }
    results.push_back(RunPlan(*t, remotes, plan));
    names.push_back("local");
  }
  {
    auto peer = PeerProcess::Spawn("shm", seed, kSizes).value();
    auto t = CreateShmTransport().value();
    results.push_back(RunPlan(*t, ImportAll(*t, *peer), plan));
    names.push_back("shm");
  }
#ifdef RC_HAVE_UCX
  for (const char* tls : {"tcp,self", "sm,self"}) {
    ScopedEnv env("UCX_TLS", tls);
    auto peer = PeerProcess::Spawn("ucx", seed, kSizes, {std::string("UCX_TLS=") + tls}).value();
    auto t = CreateUcxTransport().value();
    results.push_back(RunPlan(*t, ImportAll(*t, *peer), plan));
    names.push_back(std::string("ucx ") + tls);
  }
#endif
  ASSERT_GE(results.size(), 2u);
  ExpectPlanBytes(plan, results[0], seed);
  for (size_t i = 1; i < results.size(); ++i) {
    ASSERT_EQ(results[i].size(), results[0].size());
    EXPECT_EQ(std::memcmp(results[i].data(), results[0].data(), results[0].size()), 0)
        << names[i] << " differs from " << names[0];
  }
}

}  // namespace
}  // namespace rc::transport
