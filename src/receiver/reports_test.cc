// The receiver's typed reports as JSON (reports.h): the keys the HTTP docs name (ENGINE_API.md,
// docs/engine.md "Receiver-driven refit" and "Fan-out", docs/refit.md "Delta refit", docs/lifecycle.md
// "Replay validation"), their value types, and the optional keys present exactly when they should be.
#include "rolloutcore/receiver/reports.h"

#include <gtest/gtest.h>

#include <string>

namespace rc::receiver {
namespace {

void ExpectKeys(const Json& j, std::initializer_list<const char*> keys) {
  for (const char* k : keys) EXPECT_TRUE(j.contains(k)) << "missing " << k << " in " << j.dump();
}

void ExpectDigestText(const Json& j, const std::string& want) {
  ASSERT_TRUE(j.is_string()) << j.dump();
  EXPECT_EQ(j.get<std::string>(), want);
}

StageReport FullStage() {
  StageReport r;
  r.version = "v1";
  r.model = "tiny";
  r.mode_reason = "the engine serves v0, not the delta's base v1";
  r.transport = "shm";
  r.bytes_pulled = 4096;
  r.threads = 2;
  r.digest_check = "staged bytes match the manifest, tensor by tensor";
  r.content_digest = ContentDigest(0xabcdef0123456789ull);
  r.stages_ms = {{"discovery", 1.5}, {"wire", 2.0}, {"receive_sync", 0.25}, {"total", 4.0}};
  FullStageReport full;
  full.bytes_needed = 4000;
  full.bytes_planned = 4096;
  full.reads = 3;
  full.descriptors = 2;
  full.plan_cached = true;
  full.transports_built = 1;
  full.params_digested_while_landing = 7;
  full.wire_gbps = 1.25;
  r.by_mode = full;
  r.prereplay.report.probes = 2;
  r.prereplay.report.why = "the version carries no probes";
  r.call_ms = 5.5;
  return r;
}

TEST(ReceiverReports, FullStageHasTheDocumentedKeys) {
  const StageReport r = FullStage();
  const Json j = r.ToJson();
  ExpectKeys(j, {"version",
                 "model",
                 "mode",
                 "mode_reason",
                 "transport",
                 "bytes_needed",
                 "bytes_planned",
                 "bytes_pulled",
                 "reads",
                 "descriptors",
                 "full_pulls",
                 "plan_cached",
                 "plans_built",
                 "shadow_allocated",
                 "transport_cached",
                 "transports_built",
                 "threads",
                 "coverage",
                 "digest_check",
                 "params_digested_while_landing",
                 "params_scanned_while_landing",
                 "content_digest",
                 "wire_gbps",
                 "stages_ms",
                 "prereplay",
                 "call_ms"});
  EXPECT_EQ(j["mode"], "full");
  EXPECT_EQ(j["coverage"], "ok");
  EXPECT_EQ(j["bytes_planned"], 4096);
  EXPECT_EQ(j["plan_cached"], true);
  ExpectDigestText(j["content_digest"], "abcdef0123456789");
  ASSERT_TRUE(j["stages_ms"].is_object());
  EXPECT_TRUE(j["stages_ms"]["wire"].is_number_float());
  EXPECT_EQ(j["stages_ms"]["receive_sync"], 0.25);
  EXPECT_TRUE(j["wire_gbps"].is_number_float());
  // No relays asked for: no `sources`; no delta keys on a full stage.
  EXPECT_FALSE(j.contains("sources"));
  EXPECT_FALSE(j.contains("delta_base"));
  EXPECT_FALSE(j.contains("ranks"));
  // A pre-replay that was not attempted: probes, ms, ran, why only.
  const Json& pre = j["prereplay"];
  ExpectKeys(pre, {"probes", "ms", "ran", "why"});
  EXPECT_TRUE(pre["ms"].is_number_float());
  EXPECT_FALSE(pre.contains("batched"));
  EXPECT_EQ(r.mode(), StageMode::kFull);
  ASSERT_NE(r.full(), nullptr);
  EXPECT_EQ(r.delta(), nullptr);
}

TEST(ReceiverReports, FanOutAndAttemptedPreReplaySectionsAppearWhenSet) {
  StageReport r = FullStage();
  FanOutReport fan;
  fan.origin_bytes = 10;
  fan.relay_bytes = 20;
  fan.by_holder = {{"engine-7", 20}};
  fan.holder_records = 1;
  std::get<FullStageReport>(r.by_mode).sources = fan;
  r.prereplay.attempted = true;
  r.prereplay.report.ran = true;
  r.prereplay.report.batched = true;
  const Json j = r.ToJson();
  ASSERT_TRUE(j.contains("sources")) << j.dump();
  ExpectKeys(j["sources"],
             {"origin_bytes", "relay_bytes", "by_holder", "holder_records", "failed_holders", "failovers"});
  EXPECT_EQ(j["sources"]["by_holder"]["engine-7"], 20);
  EXPECT_TRUE(j["sources"]["failed_holders"].is_array());
  ExpectKeys(j["prereplay"], {"probes", "ms", "ran", "why", "batched", "forced", "diverged", "forwards"});
  EXPECT_EQ(j["prereplay"]["batched"], true);

  fan.by_holder.clear();  // nobody relayed: still an object, not null
  std::get<FullStageReport>(r.by_mode).sources = fan;
  EXPECT_TRUE(r.ToJson()["sources"]["by_holder"].is_object());
}

TEST(ReceiverReports, DeltaStageHasTheDocumentedKeys) {
  StageReport r = FullStage();
  DeltaStageReport d;
  d.delta_apply = DeltaApply::kStaging;
  d.staging_from = StagingFrom::kReapplyPreviousDelta;
  d.delta_apply_why = "why";
  d.delta_base = "v0";
  d.delta_bytes_published = 100;
  d.full_bytes_published = 4096;
  DeltaRankReport rank;
  rank.rank = 0;
  rank.bytes_pulled = 90;
  rank.changed_in_region = 5;
  rank.region_delta_bytes = 40;
  d.ranks = {rank};
  r.by_mode = d;
  const Json j = r.ToJson();
  EXPECT_EQ(j["mode"], "delta");
  ExpectKeys(j, {"delta_apply", "staging_from", "delta_apply_why", "page_faults", "delta_base", "delta_bytes_published",
                 "full_bytes_published", "changed_published", "changed_digested", "ranks", "bytes_pulled",
                 "content_digest", "stages_ms", "coverage", "digest_check"});
  EXPECT_EQ(j["delta_apply"], "staging");
  EXPECT_EQ(j["staging_from"], "reapply_previous_delta");
  ExpectKeys(j["page_faults"], {"staging_prepare", "delta_pass"});
  ASSERT_EQ(j["ranks"].size(), 1u);
  ExpectKeys(j["ranks"][0],
             {"rank", "bytes_pulled", "changed_in_region", "region_delta_bytes", "writes", "reads", "shards_read"});
  EXPECT_FALSE(j.contains("bytes_planned"));
  EXPECT_FALSE(j.contains("wire_gbps"));
}

TEST(ReceiverReports, InstallHasTheStageKeysAndItsOwn) {
  InstallReport r;
  r.stage = FullStage();
  r.weight_version = "v1";
  r.bytes_installed = 4096;
  r.install_mode = InstallMode::kSwap;
  r.live_content_digest = ContentDigest(0x0123456789abcdefull);
  r.anchor_check.ran = true;
  r.anchor_check.reason = "full install: every live byte was digested";
  r.stages_ms = r.stage.stages_ms;
  r.stages_ms["install"] = 0.5;
  r.stages_ms["post_install"] = 0.0;
  r.stages_ms["ready"] = 0.0;
  r.call_ms = 9.0;
  Json j = r.ToJson();
  ExpectKeys(j, {"weight_version", "bytes_installed", "install_mode", "cache_reset", "live_content_digest",
                 "anchor_check", "stages_ms", "install_outcome", "call_ms",
                 // the stage's evidence rides along
                 "version", "mode", "bytes_planned", "content_digest", "prereplay"});
  EXPECT_EQ(j["install_outcome"], "installed");
  EXPECT_EQ(j["install_mode"], "swap");
  ExpectDigestText(j["live_content_digest"], "0123456789abcdef");
  ExpectDigestText(j["content_digest"], "abcdef0123456789");
  ExpectKeys(j["stages_ms"], {"discovery", "wire", "install", "post_install", "ready"});
  EXPECT_EQ(j["call_ms"], 9.0) << "the install's call_ms replaces the stage's";
  ExpectKeys(j["anchor_check"], {"ran", "ok", "reason"});
  EXPECT_FALSE(j["anchor_check"].contains("ms"));
  EXPECT_FALSE(j.contains("prereplay_adopted"));

  r.prereplay_adopted = true;
  r.anchor_check.ms = 3.0;
  j = r.ToJson();
  EXPECT_EQ(j["prereplay_adopted"], true);
  ExpectKeys(j["anchor_check"], {"ran", "ok", "reason", "ms"});

  r.anchor_check = AnchorCheckReport{};
  r.anchor_check.deltas_since_anchor = 3;
  r.anchor_check.every = 16;
  j = r.ToJson();
  EXPECT_EQ(j["anchor_check"], (Json{{"ran", false}, {"deltas_since_anchor", 3}, {"every", 16}}));
  EXPECT_EQ(InstallModeName(InstallMode::kInPlace), "in_place");
  EXPECT_EQ(InstallModeName(InstallMode::kCopy), "copy");
}

TEST(ReceiverReports, RelayAndLiveDigestHaveTheDocumentedKeys) {
  RelayReport relay;
  relay.holder = "engine-1";
  relay.from = RelayFrom::kInstalled;
  relay.content_digest = ContentDigest(1);
  const Json rj = relay.ToJson();
  ExpectKeys(
      rj, {"holder", "relay_model", "relay_version", "from", "bytes", "registrations", "content_digest", "build_ms"});
  EXPECT_EQ(rj["from"], "installed");
  ExpectDigestText(rj["content_digest"], "0000000000000001");

  LiveDigestReport d;
  d.tensors = {{"model.norm.weight", 0xffull}};
  d.content_digest = ContentDigest(refit::CombineTensorDigests(d.tensors));
  d.weight_version = "v1";
  d.computed = "now";
  const Json dj = d.ToJson();
  ExpectKeys(dj, {"content_digest", "weight_version", "tensors", "digest_ms", "computed"});
  ExpectDigestText(dj["tensors"]["model.norm.weight"], "00000000000000ff");
  EXPECT_TRUE(dj["digest_ms"].is_number_float());
}

}  // namespace
}  // namespace rc::receiver
