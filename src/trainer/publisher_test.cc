#include "rolloutcore/trainer/publisher.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "rolloutcore/base/clock.h"
#include "rolloutcore/directory/client.h"
#include "rolloutcore/directory/memory_store.h"
#include "rolloutcore/refit/digest.h"
#include "rolloutcore/trainer/fp8_parts.h"
#include "rolloutcore/transport/local.h"
#include "rolloutcore/transport/shm.h"
#include "trainer/publisher_test_util.h"

namespace rc::trainer {
namespace {

using refit::DType;
using refit::Shape;

// bf16 bits of a recognisable value per element.
std::vector<uint16_t> Pattern(int64_t n, uint16_t base) {
  std::vector<uint16_t> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = static_cast<uint16_t>(base + i * 7);
  return v;
}

ShardSource Rows(const std::string& name, const Shape& global, int64_t row0, int64_t rows, const void* data) {
  ShardSource s;
  s.name = name;
  s.dtype = DType::kBF16;
  s.global_shape = global;
  s.offset = Shape(global.size(), 0);
  s.offset[0] = row0;
  s.local_shape = global;
  s.local_shape[0] = rows;
  s.data = data;
  return s;
}

std::vector<uint8_t> ReadAll(transport::Transport& t, const std::string& descriptor, uint64_t bytes) {
  return testing::ReadRemote<uint8_t>(t, descriptor, 0, bytes);
}

// A directory whose answers can be lost: a fault-injecting wrapper around a real store.
// lose_answers: the next N publishes are applied by the store, then answered Unavailable (the
// directory died after its commit was durable). drop_publishes: the next N are answered
// Unavailable without reaching the store. down: every call is Unavailable; go_down_after_loss sets
// it when an answer is lost (the directory stays away).
class LossyDirectory final : public directory::DirectoryStore {
 public:
  explicit LossyDirectory(directory::DirectoryStore* inner) : inner_(inner) {}
  std::atomic<int> lose_answers{0};
  std::atomic<int> drop_publishes{0};
  std::atomic<bool> down{false};
  std::atomic<bool> go_down_after_loss{false};
  std::atomic<int> calls{0};

  Result<directory::PublishResult> Publish(const directory::PublishRequest& r) override {
    ++calls;
    if (down) return Down();
    if (drop_publishes > 0) {
      --drop_publishes;
      return Down();
    }
    auto out = inner_->Publish(r);
    if (lose_answers > 0) {
      --lose_answers;
      if (go_down_after_loss) down = true;
      return Down();
    }
    return out;
  }
  Result<directory::LeaseInfo> KeepAlive(int64_t id) override {
    if (down) return Down();
    return inner_->KeepAlive(id);
  }
  Result<refit::Manifest> Get(std::string_view m, std::string_view v) override {
    ++calls;
    if (down) return Down();
    return inner_->Get(m, v);
  }
  Result<directory::VersionInfo> GetInfo(std::string_view m, std::string_view v) override {
    ++calls;
    if (down) return Down();
    return inner_->GetInfo(m, v);
  }
  Result<std::vector<directory::VersionInfo>> List(std::string_view m, directory::StateFilter f) override {
    if (down) return Down();
    return inner_->List(m, f);
  }
  Result<std::vector<directory::CommitEvent>> WaitForCommits(std::string_view m, uint64_t after, int64_t t) override {
    if (down) return Down();
    return inner_->WaitForCommits(m, after, t);
  }
  Status Release(std::string_view m, std::string_view v) override {
    if (down) return Down();
    return inner_->Release(m, v);
  }
  Status MarkUnavailable(std::string_view m, std::string_view v, std::string_view reason) override {
    if (down) return Down();
    return inner_->MarkUnavailable(m, v, reason);
  }

 private:
  static Status Down() { return Unavailable("directory at http://127.0.0.1:1 did not answer: Connection"); }
  directory::DirectoryStore* const inner_;
};

class PublisherTest : public testing::PublisherFixture {};

TEST_F(PublisherTest, TwoRanksCommitAndShardsReadBackWithTheirDigests) {
  const Shape shape = {8, 4};
  const std::vector<uint16_t> full = Pattern(32, 100);
  Publisher p0(transport_.get(), store_.get(), "m", 0, 2);
  Publisher p1(transport_.get(), store_.get(), "m", 1, 2);
  ASSERT_TRUE(p0.AddShard("v0", Rows("w", shape, 0, 5, full.data())).ok());
  ASSERT_TRUE(p1.AddShard("v0", Rows("w", shape, 5, 3, full.data() + 20)).ok());
  // A 1-d tensor held whole by both ranks (a replica).
  const std::vector<uint16_t> norm = Pattern(4, 9);
  ASSERT_TRUE(p0.AddShard("v0", Rows("n", {4}, 0, 4, norm.data())).ok());
  ASSERT_TRUE(p1.AddShard("v0", Rows("n", {4}, 0, 4, norm.data())).ok());

  auto r0 = p0.Publish("v0");
  ASSERT_TRUE(r0.ok()) << r0.status().ToString();
  EXPECT_EQ(r0->result.state, directory::VersionState::kStaging);
  EXPECT_EQ(r0->shards, 2);
  EXPECT_EQ(r0->bytes, (20u + 4u) * 2u);
  auto r1 = p1.Publish("v0");
  ASSERT_TRUE(r1.ok()) << r1.status().ToString();
  EXPECT_EQ(r1->result.state, directory::VersionState::kCommitted);
  EXPECT_EQ(r1->result.commit_seq, 1u);
  EXPECT_TRUE(p0.IsPublished("v0"));
  EXPECT_NE(p0.lease_id(), 0);

  auto m = store_->Get("m", "v0");
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  ASSERT_EQ(m->tables.size(), 2u);
  for (const refit::ShardTable& t : m->tables) {
    for (const refit::ShardInfo& s : t.shards) {
      const uint64_t bytes = static_cast<uint64_t>(refit::NumElements(s.shape)) * 2;
      std::vector<uint8_t> got = ReadAll(*transport_, s.handle, bytes);
      const uint16_t* want = t.name == "w" ? full.data() + s.offset[0] * 4 : norm.data();
      ASSERT_EQ(got.size(), bytes);
      EXPECT_EQ(std::memcmp(got.data(), want, bytes), 0) << t.name << " rank " << s.rank;
      EXPECT_EQ(s.digest, refit::DigestBlock(DType::kBF16, t.shape, s.box(), got.data()));
    }
  }
  // Sharding invariance: the per-tensor digest equals the digest of the whole tensor.
  auto digests = refit::TensorDigestsFromShards(*m);
  ASSERT_TRUE(digests.ok());
  EXPECT_EQ(digests->at("w"), refit::DigestBlock(DType::kBF16, shape, refit::FullBox(shape), full.data()));
  EXPECT_EQ(m->content_digest, r1->result.content_digest);
}

// A directory that cannot be reached at all (connection refused): the publish was never sent, so
// its outcome is known. It fails at once (not after the 30 s outcome inquiry meant for a lost
// answer), saying nothing was published, and the version stays staged to publish again.
TEST_F(PublisherTest, ADirectoryThatCannotBeReachedFailsAtOnceAndKeepsTheVersionStaged) {
  directory::DirectoryClient unreachable("http://127.0.0.1:1");
  const std::vector<uint16_t> w = Pattern(32, 7);
  Publisher p(transport_.get(), &unreachable, "m", 0, 1);
  ASSERT_TRUE(p.AddShard("v0", Rows("w", {8, 4}, 0, 8, w.data())).ok());
  const auto t0 = std::chrono::steady_clock::now();
  auto r = p.Publish("v0");
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(r.status().message().find("nothing was published"), std::string::npos) << r.status().message();
  EXPECT_LT(s, 10.0) << "the outcome inquiry is only for an answer that was lost";
  EXPECT_FALSE(p.IsUnresolved("v0"));
  EXPECT_FALSE(p.IsPublished("v0"));
  EXPECT_EQ(p.versions(), std::vector<std::string>{"v0"});
}

// A transport that takes "device" regions as host memory: the device-shard paths of the Publisher
// run on the CPU (the bytes are host memory the test digests itself).
class DeviceAsHost final : public transport::Transport {
 public:
  explicit DeviceAsHost(transport::Transport* inner) : inner_(inner) {}
  std::string_view name() const override { return inner_->name(); }
  transport::Capabilities capabilities() const override {
    transport::Capabilities c = inner_->capabilities();
    c.device_memory = true;
    return c;
  }
  Clock& clock() const override { return inner_->clock(); }
  Result<transport::Registration> RegisterMemory(const transport::MemoryRegion& region) override {
    transport::MemoryRegion host = region;
    host.kind = transport::MemoryKind::kHost;
    host.device = -1;
    return inner_->RegisterMemory(host);
  }
  Status Deregister(uint64_t id) override { return inner_->Deregister(id); }
  Result<transport::RemoteMemory> Import(std::string_view d) override { return inner_->Import(d); }
  Status ReleaseRemote(const transport::RemoteMemory& r) override { return inner_->ReleaseRemote(r); }
  Result<std::unique_ptr<transport::Transfer>> PostReads(std::span<const transport::ReadOp> ops) override {
    return inner_->PostReads(ops);
  }

 private:
  transport::Transport* inner_;
};

// PublisherOptions::device_digester: every device shard added without a digest is digested in one
// call at Publish (host shards and shards with a digest are not passed); its failure or a wrong
// count fails the publish, names it, and leaves the version staged to retry.
TEST_F(PublisherTest, DeviceShardsWithoutADigestAreDigestedInOneCallAtPublish) {
  DeviceAsHost device(transport_.get());
  int calls = 0;
  size_t passed = 0;
  int mode = 0;  // 0: digest, 1: fail, 2: one digest short
  PublisherOptions o;
  o.device_digester = [&](const std::vector<const ShardSource*>& shards) -> Result<std::vector<uint64_t>> {
    ++calls;
    passed = shards.size();
    if (mode == 1) return Unavailable("cudaErrorLaunchFailure");
    std::vector<uint64_t> out;
    for (const ShardSource* s : shards) {
      EXPECT_EQ(s->memory_kind, transport::MemoryKind::kDevice) << s->name;
      out.push_back(refit::DigestBlock(s->dtype, s->global_shape, refit::Box{s->offset, s->local_shape}, s->data));
    }
    if (mode == 2) out.pop_back();
    return out;
  };
  Publisher p(&device, store_.get(), "m", 0, 1, o);
  const Shape shape = {8, 4};
  const std::vector<uint16_t> w = Pattern(32, 300), n = Pattern(4, 7), h = Pattern(6, 50);
  auto on_device = [](ShardSource s) {
    s.memory_kind = transport::MemoryKind::kDevice;
    s.device = 0;
    return s;
  };
  const ShardSource a = on_device(Rows("w", shape, 0, 8, w.data()));
  ASSERT_TRUE(p.AddShard("v0", a).ok());
  ASSERT_TRUE(p.AddShard("v0", on_device(Rows("n", {4}, 0, 4, n.data()))).ok());
  ASSERT_TRUE(p.AddShard("v0", Rows("h", {6}, 0, 6, h.data())).ok());  // host: the Publisher digests it

  auto expect_refused = [&](int m, StatusCode code, const std::string& text) {
    mode = m;
    auto r = p.Publish("v0");
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), code) << r.status().ToString();
    EXPECT_NE(r.status().ToString().find(text), std::string::npos) << r.status().ToString();
  };
  expect_refused(1, StatusCode::kUnavailable, "rank 0 digesting 2 device shards of version v0");
  expect_refused(2, StatusCode::kInternal, "answered 1 digests for 2 shards");
  EXPECT_FALSE(p.IsPublished("v0"));

  mode = 0;
  calls = 0;
  auto r = p.Publish("v0");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(passed, 2u);
  EXPECT_EQ(r->result.state, directory::VersionState::kCommitted);
  auto m = store_->Get("m", "v0");
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  auto digests = refit::TensorDigestsFromShards(*m);
  ASSERT_TRUE(digests.ok());
  EXPECT_EQ(digests->at("w"), refit::DigestBlock(DType::kBF16, shape, refit::FullBox(shape), w.data()));
  EXPECT_EQ(digests->at("n"), refit::DigestBlock(DType::kBF16, {4}, refit::FullBox({4}), n.data()));
  EXPECT_EQ(digests->at("h"), refit::DigestBlock(DType::kBF16, {6}, refit::FullBox({6}), h.data()));

  // Without a digester a device shard without a digest is refused, named.
  Publisher plain(&device, store_.get(), "m2", 0, 1);
  ASSERT_TRUE(plain.AddShard("v0", a).ok());
  auto refused = plain.Publish("v0");
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().ToString().find("tensor w of version v0: a shard in device memory needs its digest"),
            std::string::npos)
      << refused.status().ToString();
}

// FP8 parts (PublisherOptions::fp8_quantizations): each rank publishes its shards' parts, and the
// committed manifest's image is the one a rank holding the whole tensor computes.
TEST_F(PublisherTest, Fp8PartsArePublishedWithTheShardsAndAddUpToTheWholeImage) {
  const std::string o = "model.layers.0.self_attn.o_proj.weight";
  const Shape shape = {8, 4};
  const std::vector<uint16_t> full = Pattern(32, 0x3C00);
  PublisherOptions po;
  po.fp8_quantizations = {"fp8_per_channel"};  // whole rows: no exchange needed
  Publisher p0(transport_.get(), store_.get(), "m", 0, 2, po);
  Publisher p1(transport_.get(), store_.get(), "m", 1, 2, po);
  ASSERT_TRUE(p0.AddShard("v0", Rows(o, shape, 0, 5, full.data())).ok());
  ASSERT_TRUE(p1.AddShard("v0", Rows(o, shape, 5, 3, full.data() + 20)).ok());
  const std::vector<uint16_t> norm = Pattern(4, 9);
  ASSERT_TRUE(p0.AddShard("v0", Rows("model.norm.weight", {4}, 0, 4, norm.data())).ok());
  auto r0 = p0.Publish("v0");
  ASSERT_TRUE(r0.ok()) << r0.status().ToString();
  ASSERT_TRUE(p1.Publish("v0").ok());
  auto m = store_->Get("m", "v0");
  ASSERT_TRUE(m.ok());
  auto image = refit::PublishedFp8Image(*m, "fp8_per_channel");
  ASSERT_TRUE(image.ok()) << image.status().ToString();
  auto whole = Fp8ShardParts({Fp8ShardInput{o, DType::kBF16, shape, refit::FullBox(shape), full.data()}},
                             "fp8_per_channel");
  ASSERT_TRUE(whole.ok()) << whole.status().ToString();
  EXPECT_EQ(image->at(o), *(*whole)[0]);
  for (const refit::ShardTable& t : m->tables) {
    EXPECT_EQ(t.shards[0].fp8.empty(), t.name == "model.norm.weight") << t.name;
  }

  // Per tensor the one scale spans both ranks: without an exchange the publish names the group.
  PublisherOptions pt;
  pt.fp8_quantizations = {"fp8_per_tensor"};
  Publisher q0(transport_.get(), store_.get(), "m", 0, 2, pt);
  ASSERT_TRUE(q0.AddShard("v1", Rows(o, shape, 0, 5, full.data())).ok());
  auto refused = q0.Publish("v1");
  ASSERT_EQ(refused.status().code(), StatusCode::kFailedPrecondition) << refused.status().ToString();
  EXPECT_NE(refused.status().message().find("scale group"), std::string::npos) << refused.status().ToString();

  // Parts the caller computed: checked against what is staged.
  Publisher a(transport_.get(), store_.get(), "m", 0, 1);
  ASSERT_TRUE(a.AddShard("v2", Rows(o, shape, 0, 8, full.data())).ok());
  refit::Fp8ImageDigest part{1, 2};
  EXPECT_EQ(a.AttachFp8Parts("v2", {{o, {4, 0}, "fp8_per_tensor", part}}).code(), StatusCode::kNotFound);
  EXPECT_EQ(a.AttachFp8Parts("v2", {{o, {0, 0}, "int8", part}}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(a.AttachFp8Parts("v2", {{"model.norm.weight", {0}, "fp8_per_tensor", part}}).code(),
            StatusCode::kInvalidArgument);
  ASSERT_TRUE(a.AttachFp8Parts("v2", {{o, {0, 0}, "fp8_per_tensor", part}}).ok());
  auto ra = a.Publish("v2");
  ASSERT_TRUE(ra.ok()) << ra.status().ToString();
  EXPECT_EQ(ra->tables[0].shards[0].fp8.at("fp8_per_tensor"), part);
}

TEST_F(PublisherTest, GeometryErrorsNameTensorRankAndVersion) {
  const std::vector<uint16_t> d = Pattern(64, 1);
  Publisher p(transport_.get(), store_.get(), "m", 1, 2);
  Status s = p.AddShard("v3", Rows("layer.w", {8, 4}, 6, 4, d.data()));
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("layer.w"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("rank 1"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("v3"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("outside"), std::string::npos) << s.message();

  EXPECT_EQ(p.AddShard("v3", Rows("w", {8, 4}, 0, 4, nullptr)).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(p.AddShard("v3", Rows("w", {8, 4}, 0, 4, d.data())).ok());
  s = p.AddShard("v3", Rows("w", {8, 4}, 2, 4, d.data()));
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("overlaps"), std::string::npos) << s.message();
  ShardSource other_dtype = Rows("w", {8, 4}, 4, 4, d.data());
  other_dtype.dtype = DType::kF32;
  EXPECT_EQ(p.AddShard("v3", other_dtype).code(), StatusCode::kInvalidArgument);
  ShardSource bad_rank = Rows("w", {8, 4}, 4, 4, d.data());
  bad_rank.offset = {4};
  EXPECT_EQ(p.AddShard("v3", bad_rank).code(), StatusCode::kInvalidArgument);
}

// A label the directory would refuse at publish is refused at the first add_shard, before anything
// of that version is staged.
TEST_F(PublisherTest, LabelsTheDirectoryRefusesAreRefusedAtAddShard) {
  const std::vector<uint16_t> d = Pattern(32, 1);
  Publisher p(transport_.get(), store_.get(), "m", 0, 1);
  for (const char* version : {"", "v/1", "v 1", "..", "v?1"}) {
    Status s = p.AddShard(version, Rows("w", {8, 4}, 0, 8, d.data()));
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << version;
    EXPECT_NE(s.message().find("version"), std::string::npos) << s.message();
  }
  EXPECT_EQ(p.Publish("v/1").status().code(), StatusCode::kNotFound) << "nothing was staged under it";
  Publisher bad_model(transport_.get(), store_.get(), "m/x", 0, 1);
  Status s = bad_model.AddShard("v1", Rows("w", {8, 4}, 0, 8, d.data()));
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("model: character 0x2f"), std::string::npos) << s.message();
  EXPECT_TRUE(p.AddShard("v1.0-rc+2", Rows("w", {8, 4}, 0, 8, d.data())).ok());
}

TEST_F(PublisherTest, StateErrors) {
  const std::vector<uint16_t> d = Pattern(32, 1);
  Publisher p(transport_.get(), store_.get(), "m", 0, 1);
  EXPECT_EQ(p.Publish("v0").status().code(), StatusCode::kNotFound);
  ASSERT_TRUE(p.AddShard("v0", Rows("w", {8, 4}, 0, 8, d.data())).ok());
  auto r = p.Publish("v0");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->result.state, directory::VersionState::kCommitted);
  EXPECT_EQ(p.Publish("v0").status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(p.AddShard("v0", Rows("x", {2}, 0, 2, d.data())).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(p.Release("v9").code(), StatusCode::kNotFound);
}

TEST_F(PublisherTest, DirectoryRefusalLeavesTheVersionStagedAndRegistersNothing) {
  const std::vector<uint16_t> d = Pattern(32, 1);
  // Rank 0 of 2 publishes with expected_ranks 2; a second publisher claims expected_ranks 3.
  Publisher a(transport_.get(), store_.get(), "m", 0, 2);
  Publisher b(transport_.get(), store_.get(), "m", 1, 3);
  ASSERT_TRUE(a.AddShard("v0", Rows("w", {8, 4}, 0, 4, d.data())).ok());
  ASSERT_TRUE(a.Publish("v0").ok());
  ASSERT_TRUE(b.AddShard("v0", Rows("w", {8, 4}, 4, 4, d.data() + 16)).ok());
  auto r = b.Publish("v0");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(r.status().message().find("rank 1"), std::string::npos) << r.status().message();
  EXPECT_FALSE(b.IsPublished("v0"));
  EXPECT_EQ(b.versions(), std::vector<std::string>{"v0"});  // still staged: can be released or retried
  EXPECT_TRUE(b.Release("v0").ok());
}

TEST_F(PublisherTest, ReleaseDeregistersAndReleasesInTheDirectory) {
  const std::vector<uint16_t> d = Pattern(32, 1);
  auto owner = std::make_shared<std::vector<uint16_t>>(d);
  std::weak_ptr<std::vector<uint16_t>> watch = owner;
  Publisher p(transport_.get(), store_.get(), "m", 0, 1);
  ShardSource s = Rows("w", {8, 4}, 0, 8, owner->data());
  s.keep_alive = std::move(owner);
  ASSERT_TRUE(p.AddShard("v0", std::move(s)).ok());
  auto r = p.Publish("v0");
  ASSERT_TRUE(r.ok());
  const std::string handle = r->tables[0].shards[0].handle;
  EXPECT_EQ(ReadAll(*transport_, handle, 64).size(), 64u);
  EXPECT_FALSE(watch.expired());  // the Publisher holds the memory while published

  ASSERT_TRUE(p.Release("v0", /*release_in_directory=*/true).ok());
  EXPECT_TRUE(watch.expired());
  EXPECT_TRUE(p.versions().empty());
  EXPECT_EQ(store_->Get("m", "v0").status().code(), StatusCode::kNotFound);
  // Deregistered: a reader can no longer reach the region.
  auto remote = transport_->Import(handle);
  ASSERT_FALSE(remote.ok());
  EXPECT_EQ(remote.status().code(), StatusCode::kNotFound) << remote.status().ToString();
}

TEST_F(PublisherTest, ShmRequiresShmBufferMemoryAndWorksWithIt) {
  auto shm = transport::CreateShmTransport();
  ASSERT_TRUE(shm.ok()) << shm.status().ToString();
  const std::vector<uint16_t> d = Pattern(32, 3);
  Publisher p(shm->get(), store_.get(), "m", 0, 1);
  ASSERT_TRUE(p.AddShard("v0", Rows("w", {8, 4}, 0, 8, d.data())).ok());
  auto r = p.Publish("v0");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition) << r.status().ToString();
  EXPECT_NE(r.status().message().find("tensor w"), std::string::npos) << r.status().message();
  EXPECT_EQ(store_->GetInfo("m", "v0").status().code(), StatusCode::kNotFound);  // nothing published
  ASSERT_TRUE(p.Release("v0").ok());

  auto buf = transport::ShmBuffer::Create(64);
  ASSERT_TRUE(buf.ok());
  auto owned = std::make_shared<transport::ShmBuffer>(std::move(buf).value());
  std::memcpy(owned->data(), d.data(), 64);
  ShardSource s = Rows("w", {8, 4}, 0, 8, owned->data());
  s.keep_alive = owned;
  ASSERT_TRUE(p.AddShard("v1", std::move(s)).ok());
  auto ok = p.Publish("v1");
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  std::vector<uint8_t> got = ReadAll(**shm, ok->tables[0].shards[0].handle, 64);
  ASSERT_EQ(got.size(), 64u);
  EXPECT_EQ(std::memcmp(got.data(), d.data(), 64), 0);
}

TEST_F(PublisherTest, ExpiredLeaseAbandonsStagingAndANewLeaseIsTakenForTheNextVersion) {
  const std::vector<uint16_t> d = Pattern(32, 1);
  PublisherOptions o;
  o.lease_ttl_ms = 1000;
  o.keepalive_interval_ms = 3'600'000;  // never renews during the test: the lease runs out
  Publisher p(transport_.get(), store_.get(), "m", 0, 2, o);
  ASSERT_TRUE(p.AddShard("v0", Rows("w", {8, 4}, 0, 4, d.data())).ok());
  auto r = p.Publish("v0");
  ASSERT_TRUE(r.ok());
  const int64_t first_lease = r->result.lease_id;
  clock_.AdvanceMs(1500);
  auto info = store_->GetInfo("m", "v0");
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->state, directory::VersionState::kAbandoned);

  ASSERT_TRUE(p.AddShard("v1", Rows("w", {8, 4}, 0, 4, d.data())).ok());
  auto r1 = p.Publish("v1");
  ASSERT_TRUE(r1.ok()) << r1.status().ToString();
  EXPECT_NE(r1->result.lease_id, first_lease);
  EXPECT_EQ(p.lease_id(), r1->result.lease_id);
}

TEST_F(PublisherTest, ConcurrentVersionsOnOnePublisher) {
  const std::vector<uint16_t> d = Pattern(32, 5);
  Publisher p(transport_.get(), store_.get(), "m", 0, 1);
  std::vector<std::thread> threads;
  threads.reserve(8);
  std::vector<Status> results(8);
  for (int i = 0; i < 8; ++i) {
    threads.emplace_back([&, i] {
      // (Built with append: GCC 12 at -O3 reports a false -Wrestrict for "literal" + std::string, GCC PR 105329.)
      const std::string v = std::string("v").append(std::to_string(i));
      Status s = p.AddShard(v, Rows("w", {8, 4}, 0, 8, d.data()));
      if (s.ok()) s = p.Publish(v).status();
      results[static_cast<size_t>(i)] = s;
    });
  }
  for (auto& t : threads) t.join();
  for (const Status& s : results) EXPECT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(p.versions().size(), 8u);
  auto list = store_->List("m");
  ASSERT_TRUE(list.ok());
  EXPECT_EQ(list->size(), 8u);
}

// Defect 5 of issue 13: the directory committed, then died before answering. The Publisher must
// not drop the buffers the committed version names: it asks, learns it committed, and serves.
TEST_F(PublisherTest, ALostCommitAnswerIsResolvedByAskingAndTheBuffersStayServed) {
  const std::vector<uint16_t> d = Pattern(32, 40);
  LossyDirectory dir(store_.get());
  dir.lose_answers = 1;
  PublisherOptions o;
  o.outcome_retry_ms = 1;
  Publisher p(transport_.get(), &dir, "m", 0, 1, o);
  ASSERT_TRUE(p.AddShard("v0", Rows("w", {8, 4}, 0, 8, d.data())).ok());
  auto r = p.Publish("v0");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->result.state, directory::VersionState::kCommitted);
  EXPECT_EQ(r->result.commit_seq, 1u);
  EXPECT_TRUE(p.IsPublished("v0"));
  auto m = store_->Get("m", "v0");
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(m->content_digest, r->result.content_digest);
  const std::string handle = m->tables[0].shards[0].handle;
  EXPECT_EQ(handle, r->tables[0].shards[0].handle);
  std::vector<uint8_t> got = ReadAll(*transport_, handle, 64);
  ASSERT_EQ(got.size(), 64u);
  EXPECT_EQ(std::memcmp(got.data(), d.data(), 64), 0);
}

// The answer was lost before the store saw the publish (the directory died first): asking finds
// the version STAGING without this rank, and the same tables are published again.
TEST_F(PublisherTest, APublishLostBeforeTheDirectoryAppliedItIsSentAgain) {
  const std::vector<uint16_t> d = Pattern(32, 2);
  LossyDirectory dir(store_.get());
  PublisherOptions o;
  o.outcome_retry_ms = 1;
  Publisher p0(transport_.get(), &dir, "m", 0, 2, o);
  Publisher p1(transport_.get(), &dir, "m", 1, 2, o);
  ASSERT_TRUE(p0.AddShard("v0", Rows("w", {8, 4}, 0, 4, d.data())).ok());
  ASSERT_TRUE(p1.AddShard("v0", Rows("w", {8, 4}, 4, 4, d.data() + 16)).ok());
  ASSERT_TRUE(p0.Publish("v0").ok());
  dir.drop_publishes = 1;
  auto r = p1.Publish("v0");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->result.state, directory::VersionState::kCommitted);
  EXPECT_EQ(r->result.ranks_published, 2);
  EXPECT_NE(r->result.lease_id, 0);
  auto m = store_->Get("m", "v0");
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(ReadAll(*transport_, m->tables[0].shards[1].handle, 32).size(), 32u);
}

// The directory stays away past the outcome deadline: Publish says the outcome is unknown, the
// buffers stay registered (the store did commit them), and a later Publish resumes the inquiry
// with the same handles and learns the commit.
TEST_F(PublisherTest, AnUnknownOutcomeKeepsTheBuffersUntilTheDirectoryAnswers) {
  const std::vector<uint16_t> d = Pattern(32, 7);
  LossyDirectory dir(store_.get());
  dir.lose_answers = 1;
  dir.go_down_after_loss = true;
  PublisherOptions o;
  o.outcome_timeout_ms = 100;
  o.outcome_retry_ms = 5;
  Publisher p(transport_.get(), &dir, "m", 0, 1, o);
  ASSERT_TRUE(p.AddShard("v0", Rows("w", {8, 4}, 0, 8, d.data())).ok());
  auto r = p.Publish("v0");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kUnavailable) << r.status().ToString();
  EXPECT_NE(r.status().message().find("outcome unknown"), std::string::npos) << r.status().message();
  EXPECT_NE(r.status().message().find("rank 0"), std::string::npos) << r.status().message();
  EXPECT_TRUE(p.IsUnresolved("v0"));
  EXPECT_FALSE(p.IsPublished("v0"));
  EXPECT_EQ(p.AddShard("v0", Rows("x", {2}, 0, 2, d.data())).code(), StatusCode::kFailedPrecondition);
  // The store committed it; its handles still reach the bytes.
  auto m = store_->Get("m", "v0");
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  const std::string handle = m->tables[0].shards[0].handle;
  std::vector<uint8_t> got = ReadAll(*transport_, handle, 64);
  ASSERT_EQ(got.size(), 64u);
  EXPECT_EQ(std::memcmp(got.data(), d.data(), 64), 0);

  dir.down = false;
  auto again = p.Publish("v0");
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(again->result.state, directory::VersionState::kCommitted);
  EXPECT_EQ(again->tables[0].shards[0].handle, handle);  // not re-registered
  EXPECT_TRUE(p.IsPublished("v0"));
}

// PublisherOptions::interrupted (Ctrl-C in Python) ends the outcome inquiry long before its
// timeout, with the outcome still unknown: the buffers stay registered and a later Publish resumes.
TEST_F(PublisherTest, AnInterruptedOutcomeInquiryKeepsTheVersionUnresolved) {
  const std::vector<uint16_t> d = Pattern(32, 9);
  LossyDirectory dir(store_.get());
  dir.lose_answers = 1;
  dir.go_down_after_loss = true;
  std::atomic<int> asked{0};
  PublisherOptions o;
  o.outcome_timeout_ms = 60'000;
  o.outcome_retry_ms = 5;
  o.interrupted = [&asked] { return ++asked >= 3; };
  Publisher p(transport_.get(), &dir, "m", 0, 1, o);
  ASSERT_TRUE(p.AddShard("v0", Rows("w", {8, 4}, 0, 8, d.data())).ok());
  const auto t0 = std::chrono::steady_clock::now();
  auto r = p.Publish("v0");
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(10)) << "not the 60 s timeout";
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kAborted) << r.status().ToString();
  EXPECT_NE(r.status().message().find("interrupted while asking the directory"), std::string::npos)
      << r.status().message();
  EXPECT_EQ(asked.load(), 3);
  EXPECT_TRUE(p.IsUnresolved("v0"));
  dir.down = false;
  asked = -1000;  // no more interruptions (the Publisher keeps its copy of the options)
  auto again = p.Publish("v0");
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(again->result.state, directory::VersionState::kCommitted);
}

// Sources gone: a publisher dropping the buffers of a committed version (Release without the
// directory, or its destructor) marks it UNAVAILABLE, so receivers are refused up front.
TEST_F(PublisherTest, DroppingTheBuffersOfACommittedVersionMarksItUnavailable) {
  const std::vector<uint16_t> d = Pattern(32, 3);
  {
    Publisher p(transport_.get(), store_.get(), "m", 0, 1);
    ASSERT_TRUE(p.AddShard("v0", Rows("w", {8, 4}, 0, 8, d.data())).ok());
    ASSERT_TRUE(p.AddShard("v1", Rows("w", {8, 4}, 0, 8, d.data())).ok());
    ASSERT_TRUE(p.AddShard("v2", Rows("w", {8, 4}, 0, 8, d.data())).ok());
    ASSERT_TRUE(p.Publish("v0").ok());
    ASSERT_TRUE(p.Publish("v1").ok());
    ASSERT_TRUE(p.Release("v0").ok());
    auto info = store_->GetInfo("m", "v0");
    ASSERT_TRUE(info.ok());
    EXPECT_EQ(info->state, directory::VersionState::kUnavailable);
    EXPECT_EQ(info->commit_seq, 1u);
    EXPECT_NE(info->reason.find("rank 0 of model m released its buffers"), std::string::npos) << info->reason;
    EXPECT_EQ(store_->Get("m", "v0").status().code(), StatusCode::kFailedPrecondition);
    // A staged version was never in the directory: releasing it asks nothing there.
    ASSERT_TRUE(p.Release("v2").ok());
    EXPECT_EQ(store_->GetInfo("m", "v2").status().code(), StatusCode::kNotFound);
    EXPECT_TRUE(store_->Get("m", "v1").ok());
  }
  auto v1 = store_->GetInfo("m", "v1");  // the destructor dropped v1's buffers
  ASSERT_TRUE(v1.ok());
  EXPECT_EQ(v1->state, directory::VersionState::kUnavailable);
  auto committed = store_->List("m");
  ASSERT_TRUE(committed.ok());
  EXPECT_TRUE(committed->empty());
}

}  // namespace
}  // namespace rc::trainer
