// Sparse delta refit end to end (issue 14; docs/refit.md "Delta refit"): real directory, trainer
// (--change-fraction 0.01 --delta), engine and controller processes. A 2-layer Qwen3 of hidden 256
// (so that a tp:2 rank's share of a tensor spans whole delta tiles) stands in for a real model.
//  * Five consecutive delta updates through the controller at tp 1 and tp 2, over shm and UCX:
//    every stage is a delta stage, the live digest equals the manifest after each, greedy output
//    equals a fresh engine loaded from the trainer's export of that version, and each rank pulls
//    at most 1.2x the plain encoding of the changes landing in its own region.
//  * An engine not on the delta's base pulls in full, commits, and says why.
//  * A corrupted delta (flipped value bit, wrong index, missing element) is refused at stage with
//    nothing live changed; a write that does not land (only visible after install) taints, and the
//    recovery pulls in full.
//  * Delta on the staging image: once a full stage made a staging image, a delta is applied to it
//    while the old version serves and swapped in (first by copying the live weights into it, then
//    by re-applying the previous delta); a wrong previous delta is refused at stage, and the next
//    stage falls back to the copy.
#include <gtest/gtest.h>
#include <httplib.h>

#include <fstream>

#include "system/system_fixture.h"

namespace rc::system_test {
namespace {

class DeltaRefitTest : public SystemTest {
 protected:
  // Writes the test model's config.json (Qwen3, hidden 256, 4 q heads / 2 kv heads of 64,
  // intermediate 512, vocab 512, 2 layers) and makes it the trainer's and the exports' model.
  void UseSmallModel() {
    fs::create_directories(dir_ + "/small");
    Json c = {{"architectures", {"Qwen3ForCausalLM"}},
              {"attention_bias", false},
              {"head_dim", 64},
              {"hidden_act", "silu"},
              {"hidden_size", 256},
              {"intermediate_size", 512},
              {"max_position_embeddings", 256},
              {"model_type", "qwen3"},
              {"num_attention_heads", 4},
              {"num_hidden_layers", 2},
              {"num_key_value_heads", 2},
              {"rms_norm_eps", 1e-6},
              {"rope_theta", 1000000.0},
              {"tie_word_embeddings", false},
              {"vocab_size", 512}};
    std::ofstream(dir_ + "/small/config.json") << c.dump(1);
    model_ = dir_ + "/small/config.json";
  }
  void ExportVersion(const std::string& version, const std::string& out) {
    ChildProcess* c = Start("export-" + version, {"trainer", "export", "--model", model_, "--seed", kSeed, "--lr",
                                                  kLr, "--change-fraction", "0.01", "--version", version, "--out", out});
    ASSERT_NE(c, nullptr);
    while (c->Alive()) std::this_thread::sleep_for(std::chrono::milliseconds(20));
    ASSERT_EQ(c->Stop(), 0) << c->LogTail();
  }
  int StartDeltaTrainer(int dir_port, const std::string& transport) {
    int port = apps::FreePort().value();
    ChildProcess* t = Start("trainer", {"trainer", "serve", "--model", model_, "--name", kModelName, "--layout",
                                        "fsdp:2", "--directory", Url(dir_port), "--transport", transport, "--seed",
                                        kSeed, "--lr", kLr, "--change-fraction", "0.01", "--delta", "--port",
                                        std::to_string(port)});
    EXPECT_TRUE(WaitHealthy(t, port, "/status"));
    return port;
  }
  // The delta mechanics tests pin --delta-policy always: under auto, once both modes were measured,
  // which one a stage takes depends on this machine's timings (AutoAndNeverPolicies covers auto).
  int StartTpEngine(const std::string& name, const std::string& model_dir, const std::string& label, int tp,
                    int full_verify_every = 16, const std::string& delta_policy = "always") {
    int port = apps::FreePort().value();
    ChildProcess* e = Start(name, {"engine", "serve", "--model", model_dir, "--tensor-parallel-size",
                                   std::to_string(tp), "--port", std::to_string(port), "--weight-version", label,
                                   "--served-model-name", kModelName, "--threads", "1", "--enable-fault-injection",
                                   "--full-verify-every", std::to_string(full_verify_every), "--delta-policy",
                                   delta_policy});
    EXPECT_TRUE(WaitHealthy(e, port, "/health"));
    return port;
  }
  // Directory, delta trainer (v0 committed), engine at `tp` from the exported v0, controller.
  Stack StartDeltaStack(const std::string& transport, int tp, int full_verify_every = 16,
                        const std::string& delta_policy = "always") {
    UseSmallModel();
    Stack s;
    s.state_dir = dir_ + "/controller";
    s.v0_dir = dir_ + "/v0";
    s.dir = StartDirectory();
    ExportVersion("v0", s.v0_dir);
    s.engine = StartTpEngine("engine", s.v0_dir, "v0", tp, full_verify_every, delta_policy);
    s.trainer = StartDeltaTrainer(s.dir, transport);
    WaitCommitted(s.dir, "v0");
    StartController(s);
    return s;
  }
  // The trainer's next step; returns its /step answer (delta_base, delta_bytes, ...).
  Json DeltaStep(const Stack& s, const std::string& version) {
    Json r = Call(s.trainer, "POST", "/step");
    EXPECT_EQ(r.value("version", std::string()), version);
    WaitCommitted(s.dir, version);
    return r;
  }
  // The engine's stage evidence the controller journaled for the last stage of `version`.
  Json StagedEvidence(int ctl, const std::string& version) {
    Json last = Json::object();
    for (const Json& r : Journal(ctl)) {
      if (r.value("event", std::string()) != "staged") continue;
      if (r["detail"].value("label", std::string()) == version) last = r["detail"]["engine"];
    }
    EXPECT_FALSE(last.empty()) << "no staged record of " << version << " in the journal";
    return last;
  }
  std::vector<int64_t> Greedy(int engine) { return Tokens(Complete(engine, Prompt(8, 3), 12)); }
};

// 5 consecutive delta updates through the controller.
class DeltaChainTest : public DeltaRefitTest,
                       public ::testing::WithParamInterface<std::tuple<std::string, int>> {};

TEST_P(DeltaChainTest, FiveDeltaUpdatesMatchTheManifestAndAFreshEngine) {
  const auto [transport, tp] = GetParam();
  Stack s = StartDeltaStack(transport, tp);
  // (Names built with append: GCC 12 at -O3 reports a false -Wrestrict for "literal" + std::string, GCC PR 105329.)
  for (int k = 1; k <= 5; ++k) {
    const std::string v = std::string("v").append(std::to_string(k));
    SCOPED_TRACE(v);
    Json step = DeltaStep(s, v);
    EXPECT_EQ(step["delta_base"], std::string("v").append(std::to_string(k - 1)));
    Json manifest = WaitCommitted(s.dir, v);
    Json entry = UpdateAndWait(s.ctl, v);
    EXPECT_EQ(entry.value("phase", std::string()), "READY") << entry.dump();
    Json staged = StagedEvidence(s.ctl, v);
    EXPECT_EQ(staged["mode"], "delta") << staged.dump();
    EXPECT_EQ(staged["delta_apply"], "live") << "loaded from disk, no full stage: no staging image to apply to";
    EXPECT_EQ(staged["delta_base"], std::string("v").append(std::to_string(k - 1)));
    EXPECT_EQ(staged["changed_published"], step["delta_changed"]);
    ASSERT_EQ(staged["ranks"].size(), static_cast<size_t>(tp));
    for (const Json& r : staged["ranks"]) {
      const double pulled = r["bytes_pulled"].get<double>(), region = r["region_delta_bytes"].get<double>();
      EXPECT_GT(region, 0);
      EXPECT_LE(pulled, 1.2 * region) << "rank " << r["rank"] << " pulled " << pulled << " bytes for " << region
                                      << " bytes of changes in its region";
      if (tp == 2) {
        EXPECT_LT(r["changed_in_region"].get<int64_t>(), step["delta_changed"].get<int64_t>())
            << "a tp:2 rank receives only the changes landing in its shard";
      }
    }
    const double full = staged["full_bytes_published"].get<double>();
    EXPECT_LT(staged["bytes_pulled"].get<double>(), 0.05 * full) << "a delta moves a few percent of the model";
    EXPECT_EQ(LiveDigest(s.engine), manifest["content_digest"]) << "live weights == " << v << " after the delta";
    // A fresh engine loaded from the trainer's export of v generates exactly what the delta-updated one does.
    const std::string out = dir_ + "/" + v;
    ExportVersion(v, out);
    int fresh = StartTpEngine("fresh-" + v, out, v, tp);
    EXPECT_EQ(LiveDigest(fresh), manifest["content_digest"]);
    std::vector<int64_t> got = Greedy(s.engine);
    EXPECT_FALSE(got.empty());
    EXPECT_EQ(got, Greedy(fresh));
    Call(fresh, "POST", "/pause?mode=abort");  // keep the machine quiet: the fresh engine is done
  }
}

INSTANTIATE_TEST_SUITE_P(TpAndTransport, DeltaChainTest,
                         ::testing::Values(std::make_tuple(std::string("shm"), 1), std::make_tuple(std::string("shm"), 2),
                                           std::make_tuple(std::string("ucx"), 1), std::make_tuple(std::string("ucx"), 2)),
                         [](const auto& p) {
                           return std::get<0>(p.param) + "_tp" + std::to_string(std::get<1>(p.param));
                         });

TEST_F(DeltaRefitTest, EngineNotOnTheBasePullsInFullAndSaysWhy) {
  Stack s = StartDeltaStack("shm", 2);
  // Engine on v0; v2 is published as a delta on v1.
  DeltaStep(s, "v1");
  Json step2 = DeltaStep(s, "v2");
  EXPECT_EQ(step2["delta_base"], "v1");
  Json m2 = WaitCommitted(s.dir, "v2");
  EXPECT_EQ(UpdateAndWait(s.ctl, "v2").value("phase", std::string()), "READY");
  Json staged = StagedEvidence(s.ctl, "v2");
  EXPECT_EQ(staged["mode"], "full");
  EXPECT_NE(staged["mode_reason"].get<std::string>().find("serves v0, not the delta's base v1"), std::string::npos)
      << staged["mode_reason"];
  EXPECT_EQ(LiveDigest(s.engine), m2["content_digest"]);
  // Back on the chain: v3 on v2 is a delta, applied to the staging image the full stage made
  // (after copying the live weights into it: the last install was full).
  DeltaStep(s, "v3");
  EXPECT_EQ(UpdateAndWait(s.ctl, "v3").value("phase", std::string()), "READY");
  Json staged3 = StagedEvidence(s.ctl, "v3");
  EXPECT_EQ(staged3["mode"], "delta");
  EXPECT_EQ(staged3["delta_apply"], "staging") << staged3.dump();
  EXPECT_EQ(staged3["staging_from"], "copy_of_live") << staged3.dump();
  // A chain v3 -> v4 -> v5 applied by an engine that missed v4: full, and it says why.
  DeltaStep(s, "v4");
  DeltaStep(s, "v5");
  Json m5 = WaitCommitted(s.dir, "v5");
  EXPECT_EQ(UpdateAndWait(s.ctl, "v5").value("phase", std::string()), "READY");
  staged = StagedEvidence(s.ctl, "v5");
  EXPECT_EQ(staged["mode"], "full");
  EXPECT_NE(staged["mode_reason"].get<std::string>().find("serves v3, not the delta's base v4"), std::string::npos)
      << staged["mode_reason"];
  EXPECT_EQ(LiveDigest(s.engine), m5["content_digest"]);
}

// The automatic choice (receiver/refit_choice.h) through the controller: with nothing measured the
// first applicable delta is taken (it moves fewer bytes); once a full and a delta stage were
// measured, every stage of a delta-carrying version names its estimates and takes the cheaper
// one, whichever this machine makes it; and policy never stages such a version in full, saying so.
TEST_F(DeltaRefitTest, AutoAndNeverPolicies) {
  Stack s = StartDeltaStack("shm", 1, 16, "auto");
  DeltaStep(s, "v1");
  DeltaStep(s, "v2");
  // The engine serves v0: v2 (on v1) is not applicable, full. This first stage allocates the
  // staging image, a one-time cost the choice does not learn from.
  EXPECT_EQ(UpdateAndWait(s.ctl, "v2").value("phase", std::string()), "READY");
  Json staged = StagedEvidence(s.ctl, "v2");
  EXPECT_EQ(staged["mode"], "full");
  // The choice said delta (nothing measured), eligibility said full: the reason is eligibility's.
  EXPECT_NE(staged["mode_reason"].get<std::string>().find("serves v0"), std::string::npos) << staged.dump();
  EXPECT_FALSE(staged.contains("delta_choice")) << "the choice did not decide this stage's mode";
  // v3 on v2: nothing measured yet, the delta moves fewer bytes: taken, and measured.
  DeltaStep(s, "v3");
  EXPECT_EQ(UpdateAndWait(s.ctl, "v3").value("phase", std::string()), "READY");
  staged = StagedEvidence(s.ctl, "v3");
  EXPECT_EQ(staged["mode"], "delta") << staged.dump();
  ASSERT_TRUE(staged.contains("delta_choice")) << staged.dump();
  EXPECT_EQ(staged["delta_choice"]["policy"], "auto");
  EXPECT_EQ(staged["delta_choice"]["full_samples"], 0);
  EXPECT_EQ(staged["delta_choice"]["delta_samples"], 0);
  EXPECT_TRUE(staged["delta_choice"]["estimated_full_ms"].is_null());
  EXPECT_TRUE(staged["delta_choice"]["estimated_delta_ms"].is_null());
  EXPECT_NE(staged["delta_choice"]["reason"].get<std::string>().find("neither mode not measured yet"),
            std::string::npos) << staged.dump();
  // v5 (on v4) to an engine on v3: full again, now on the kept staging image — measured.
  DeltaStep(s, "v4");
  DeltaStep(s, "v5");
  EXPECT_EQ(UpdateAndWait(s.ctl, "v5").value("phase", std::string()), "READY");
  EXPECT_EQ(StagedEvidence(s.ctl, "v5")["mode"], "full");
  // v6..v8: both measured; each stage takes the smaller estimate and says so.
  for (int k = 6; k <= 8; ++k) {
    const std::string v = "v" + std::to_string(k);
    DeltaStep(s, v);
    Json m = WaitCommitted(s.dir, v);
    EXPECT_EQ(UpdateAndWait(s.ctl, v).value("phase", std::string()), "READY");
    staged = StagedEvidence(s.ctl, v);
    ASSERT_TRUE(staged.contains("delta_choice")) << staged.dump();
    const Json& c = staged["delta_choice"];
    ASSERT_TRUE(c["estimated_full_ms"].is_number() && c["estimated_delta_ms"].is_number()) << c.dump();
    const bool delta_cheaper = c["estimated_delta_ms"].get<double>() <= c["estimated_full_ms"].get<double>();
    EXPECT_EQ(staged["mode"], delta_cheaper ? "delta" : "full") << c.dump();
    EXPECT_EQ(c["mode"], staged["mode"]);
    EXPECT_GE(c["full_samples"].get<int64_t>(), 1);
    EXPECT_GE(c["delta_samples"].get<int64_t>(), 1);
    EXPECT_NE(c["reason"].get<std::string>().find("estimated"), std::string::npos) << c.dump();
    EXPECT_EQ(LiveDigest(s.engine), m["content_digest"]) << v;
    Figure("auto_" + v + "_estimated_full_us", static_cast<int64_t>(c["estimated_full_ms"].get<double>() * 1000), "us");
    Figure("auto_" + v + "_estimated_delta_us", static_cast<int64_t>(c["estimated_delta_ms"].get<double>() * 1000),
           "us");
    Figure("auto_" + v + "_took_delta", delta_cheaper ? 1 : 0, "");
  }
  // Policy never: an engine on the delta's base stages it in full and says why.
  const int never = StartTpEngine("engine-never", s.v0_dir, "v0", 1, 16, "never");
  Json m1 = WaitCommitted(s.dir, "v1");
  Json st = Call(never, "POST", "/rc/refit/stage",
                 Json{{"model", kModelName}, {"version", "v1"}, {"directory", Url(s.dir)}});
  EXPECT_EQ(st.value("mode", std::string()), "full") << st.dump();
  EXPECT_EQ(st["delta_choice"]["policy"], "never") << st.dump();
  EXPECT_NE(st.value("mode_reason", std::string()).find("delta policy never"), std::string::npos) << st.dump();
  Call(never, "POST", "/pause?mode=abort");
}

// A corrupted delta payload that still parses: refused at stage, nothing live changed.
class CorruptDeltaTest : public DeltaRefitTest, public ::testing::WithParamInterface<std::string> {};

TEST_P(CorruptDeltaTest, IsRefusedAtStageBeforeAnythingLiveChanges) {
  const std::string kind = GetParam();
  Stack s = StartDeltaStack("shm", 2);
  Json m0 = WaitCommitted(s.dir, "v0");
  DeltaStep(s, "v1");
  Json c = Call(s.trainer, "POST", "/fault/corrupt_delta", Json{{"version", "v1"}, {"rank", 1}, {"kind", kind}});
  EXPECT_EQ(c["kind"], kind);
  Json entry = UpdateAndWait(s.ctl, "v1");
  EXPECT_EQ(entry.value("phase", std::string()), "READY") << "refused before mutation: back to READY on v0";
  EXPECT_NE(entry.value("outcome", std::string()), "committed") << entry.dump();
  EXPECT_EQ(LiveDigest(s.engine), m0["content_digest"]) << "nothing live changed";
  EXPECT_EQ(Call(s.engine, "GET", "/weight_info")["weight_version"], "v0");
  const std::string text = entry.dump();
  EXPECT_NE(text.find("does not lead to the published digests"), std::string::npos) << text;
}

INSTANTIATE_TEST_SUITE_P(Kinds, CorruptDeltaTest, ::testing::Values("value", "index", "missing"));

TEST_F(DeltaRefitTest, AWriteThatDoesNotLandTaintsAndRecoveryPullsInFull) {
  Stack s = StartDeltaStack("shm", 2);
  DeltaStep(s, "v1");
  Json m1 = WaitCommitted(s.dir, "v1");
  SetFaults(s.engine, Json{{"corrupt_delta_install", true}});
  Json entry = UpdateAndWait(s.ctl, "v1");
  EXPECT_EQ(entry.value("phase", std::string()), "TAINTED") << entry.dump();
  EXPECT_NE(entry.dump().find("live weights after the delta install of v1 do not match"), std::string::npos)
      << entry.dump();
  EXPECT_EQ(StagedEvidence(s.ctl, "v1")["mode"], "delta") << "the stage itself was a sound delta";
  SetFaults(s.engine, Json{{"corrupt_delta_install", false}});
  Json rec = UpdateAndWait(s.ctl, "v1", /*recovery=*/true);
  EXPECT_EQ(rec.value("phase", std::string()), "READY") << rec.dump();
  EXPECT_EQ(LiveDigest(s.engine), m1["content_digest"]);
  // The recovery's install evidence (journaled) says it pulled in full, and why.
  bool full_recovery = false;
  std::string all;
  for (const Json& r : Journal(s.ctl)) {
    all += r.dump() + "\n";
    const std::string t = r.dump();
    if (t.find("\"mode\":\"full\"") != std::string::npos &&
        t.find("the last install failed after it began writing live weights (recovery)") != std::string::npos) {
      full_recovery = true;
    }
  }
  EXPECT_TRUE(full_recovery) << "no journal record of a full recovery stage:\n" << all;
  auto recovered = FindLast(Journal(s.ctl), "recovered");
  ASSERT_TRUE(recovered.has_value());
  EXPECT_EQ((*recovered)["detail"]["evidence"]["anchor_check"]["ran"], true) << "a full digest at every recovery";
}

// Anchor checks: a full digest of the live weights every N delta installs catches memory that was
// corrupted between updates (the O(changed) proof cannot), and the mismatch taints.
TEST_F(DeltaRefitTest, AnchorCheckEveryNDeltasCatchesMemoryCorruptedBetweenUpdates) {
  Stack s = StartDeltaStack("shm", 2, /*full_verify_every=*/2);
  auto anchor_of = [&](const Json& entry) { return entry["evidence"]["install_complete"]["detail"]["anchor_check"]; };
  DeltaStep(s, "v1");
  Json e1 = UpdateAndWait(s.ctl, "v1");
  EXPECT_EQ(anchor_of(e1)["ran"], false) << e1.dump();
  DeltaStep(s, "v2");
  Json e2 = UpdateAndWait(s.ctl, "v2");
  EXPECT_EQ(e2.value("phase", std::string()), "READY");
  EXPECT_EQ(anchor_of(e2)["ran"], true) << "the 2nd delta install runs the anchor check";
  EXPECT_EQ(anchor_of(e2)["ok"], true);
  // Live memory corrupted between updates: the next delta (v3) still proves its own changes...
  SetFaults(s.engine, Json{{"corrupt_live_weight", true}});
  DeltaStep(s, "v3");
  Json e3 = UpdateAndWait(s.ctl, "v3");
  EXPECT_EQ(e3.value("phase", std::string()), "READY") << "the O(changed) proof does not read unchanged memory";
  EXPECT_EQ(anchor_of(e3)["ran"], false);
  // ...and the anchor check after v4 finds the corruption and taints.
  DeltaStep(s, "v4");
  Json e4 = UpdateAndWait(s.ctl, "v4");
  EXPECT_EQ(e4.value("phase", std::string()), "TAINTED") << e4.dump();
  EXPECT_NE(e4.dump().find("anchor check after the delta install of v4"), std::string::npos) << e4.dump();
}

// Delta on the staging image (docs/refit.md "Delta on the staging image"): a full stage makes the
// staging image; the next delta copies the live weights into it, the ones after re-apply the
// previous delta, each checked against the manifests, and the install swaps the image in.
TEST_F(DeltaRefitTest, DeltasAreAppliedToTheStagingImageAndSwappedIn) {
  Stack s = StartDeltaStack("shm", 2);
  // The engine misses v1: v2 is pulled in full (and fills the staging image).
  DeltaStep(s, "v1");
  DeltaStep(s, "v2");
  ASSERT_EQ(UpdateAndWait(s.ctl, "v2").value("phase", std::string()), "READY");
  ASSERT_EQ(StagedEvidence(s.ctl, "v2")["mode"], "full");
  const char* want_from[] = {"copy_of_live", "reapply_previous_delta", "reapply_previous_delta"};
  // (Names built with append: GCC 12 at -O3 reports a false -Wrestrict for "literal" + std::string, GCC PR 105329.)
  for (int k = 3; k <= 5; ++k) {
    const std::string v = std::string("v").append(std::to_string(k));
    SCOPED_TRACE(v);
    DeltaStep(s, v);
    Json m = WaitCommitted(s.dir, v);
    Json entry = UpdateAndWait(s.ctl, v);
    ASSERT_EQ(entry.value("phase", std::string()), "READY") << entry.dump();
    Json staged = StagedEvidence(s.ctl, v);
    EXPECT_EQ(staged["mode"], "delta") << staged.dump();
    EXPECT_EQ(staged["delta_apply"], "staging") << staged.dump();
    EXPECT_EQ(staged["staging_from"], want_from[k - 3]) << staged.dump();
    EXPECT_EQ(staged["stages_ms"].contains(k == 3 ? "staging_copy" : "staging_reapply"), true) << staged.dump();
    EXPECT_LT(staged["bytes_pulled"].get<double>(), 0.05 * staged["full_bytes_published"].get<double>());
    EXPECT_EQ(entry["evidence"]["install_complete"]["detail"]["install_mode"], "swap") << entry.dump();
    EXPECT_EQ(LiveDigest(s.engine), m["content_digest"]) << "live weights == " << v << " after the swap";
  }
  // A fresh engine loaded from the trainer's export of v5 generates what the swapped-in one does.
  ExportVersion("v5", dir_ + "/v5");
  int fresh = StartTpEngine("fresh-v5", dir_ + "/v5", "v5", 2);
  EXPECT_EQ(Greedy(s.engine), Greedy(fresh));
  Call(fresh, "POST", "/pause?mode=abort");

  // A wrong previous delta: the re-apply's digest check refuses the stage before anything live
  // changes...
  Json m5 = WaitCommitted(s.dir, "v5");
  SetFaults(s.engine, Json{{"corrupt_previous_delta", true}});
  DeltaStep(s, "v6");
  Json m6 = WaitCommitted(s.dir, "v6");
  Json refused = UpdateAndWait(s.ctl, "v6");
  EXPECT_EQ(refused.value("phase", std::string()), "READY") << refused.dump();
  EXPECT_NE(refused.value("outcome", std::string()), "committed") << refused.dump();
  EXPECT_NE(refused.dump().find("re-applying the previous delta v4 -> v5"), std::string::npos) << refused.dump();
  EXPECT_EQ(LiveDigest(s.engine), m5["content_digest"]) << "nothing live changed";
  EXPECT_EQ(Call(s.engine, "GET", "/weight_info")["weight_version"], "v5");
  // ...and the next stage copies the live weights into the staging image instead.
  Json again = UpdateAndWait(s.ctl, "v6");
  ASSERT_EQ(again.value("phase", std::string()), "READY") << again.dump();
  EXPECT_EQ(StagedEvidence(s.ctl, "v6")["staging_from"], "copy_of_live");
  EXPECT_EQ(LiveDigest(s.engine), m6["content_digest"]);

  // A write into the staging image that does not land as the delta says: the digest of what the
  // image holds after the writes shows it at stage, refused before anything live changes (on this
  // path nothing about the delta is left to be seen only after the install)...
  DeltaStep(s, "v7");
  Json m7 = WaitCommitted(s.dir, "v7");
  SetFaults(s.engine, Json{{"corrupt_delta_install", true}});
  Json bad = UpdateAndWait(s.ctl, "v7");
  EXPECT_EQ(bad.value("phase", std::string()), "READY") << bad.dump();
  EXPECT_NE(bad.value("outcome", std::string()), "committed") << bad.dump();
  EXPECT_NE(bad.dump().find("does not lead to the published digests"), std::string::npos) << bad.dump();
  EXPECT_EQ(LiveDigest(s.engine), m6["content_digest"]) << "nothing live changed";
  // ...and the retry copies the live weights into the (now unknown) staging image first.
  SetFaults(s.engine, Json{{"corrupt_delta_install", false}});
  ASSERT_EQ(UpdateAndWait(s.ctl, "v7").value("phase", std::string()), "READY");
  EXPECT_EQ(StagedEvidence(s.ctl, "v7")["staging_from"], "copy_of_live");
  EXPECT_EQ(LiveDigest(s.engine), m7["content_digest"]);
}

}  // namespace
}  // namespace rc::system_test
