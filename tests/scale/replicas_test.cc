// Eight replicas under one controller (issue 19): eight `engine serve` processes (preset tiny,
// tp 1, one thread each) behind `controller serve --max-updating 2`, rollouts running the whole
// time from two client threads. A sampler reads the controller's /v1/status every few ms: at
// most two replicas are ever out of READY, so rollouts never stop. Every trajectory's output is
// exactly the greedy output of the version its binding names (references computed straight on a
// replica before and after the update), and every replica ends on the new version with its
// digest. Then one replica is killed in the middle of the next update: it alone is TAINTED and
// the seven others commit.
#include <gtest/gtest.h>

#include <atomic>
#include <mutex>
#include <set>

#include "system/system_fixture.h"

namespace rc::scale_test {
namespace {

using apps::ChildProcess;
using system_test::NowMs;
using system_test::Prompt;
using system_test::Reply;
using system_test::SystemTest;

constexpr int kReplicas = 8;
constexpr int kMaxUpdating = 2;
constexpr int kTokens = 6;
constexpr int kPrompts = 4;

class ReplicasTest : public SystemTest {
 protected:
  int StartReplica(int i, ChildProcess** out) {
    int port = apps::FreePort().value();
    ChildProcess* e = Start("engine-" + std::to_string(i),
                            {"engine", "serve", "--model", v0_dir_, "--tensor-parallel-size", "1", "--port",
                             std::to_string(port), "--weight-version", "v0", "--served-model-name",
                             system_test::kModelName, "--threads", "1", "--enable-fault-injection"});
    EXPECT_TRUE(WaitHealthy(e, port, "/health"));
    *out = e;
    return port;
  }
  static std::vector<Json> Engines(int ctl) {
    Reply r = Http(ctl, "GET", "/v1/status", Json(), 5);
    std::vector<Json> out;
    if (r.status == 200 && r.json.contains("engines")) {
      for (const auto& e : r.json["engines"]) out.push_back(e);
    }
    return out;
  }
  std::string v0_dir_;
};

// Samples the READY count until stopped; keeps the minimum and a histogram.
struct ReadySampler {
  std::atomic<bool> stop{false};
  std::atomic<int> min_ready{kReplicas};
  std::atomic<int> samples{0};
  std::atomic<int> max_out{0};  // most replicas out of READY (and not TAINTED) at one instant
  std::thread th;
  void Start(int ctl) {
    th = std::thread([this, ctl] {
      while (!stop) {
        auto engines = StatusEngines(ctl);
        if (engines.size() == kReplicas) {
          int ready = 0, out = 0;
          for (const auto& e : engines) {
            const std::string st = e.value("state", std::string());
            if (st == "READY")
              ++ready;
            else if (st != "TAINTED")
              ++out;
          }
          min_ready = std::min(min_ready.load(), ready);
          max_out = std::max(max_out.load(), out);
          ++samples;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(3));
      }
    });
  }
  void Stop() {
    stop = true;
    if (th.joinable()) th.join();
  }
  static std::vector<Json> StatusEngines(int ctl) {
    Reply r = SystemTest::Http(ctl, "GET", "/v1/status", Json(), 5);
    std::vector<Json> out;
    if (r.status == 200 && r.json.contains("engines")) {
      for (const auto& e : r.json["engines"]) out.push_back(e);
    }
    return out;
  }
};

// Rollouts from `threads` clients until stopped; every answer is kept.
struct RolloutLoad {
  std::atomic<bool> stop{false};
  std::mutex mu;
  std::vector<std::pair<int, Reply>> replies;  // (prompt index, reply); guarded by mu
  std::vector<std::thread> ths;
  void Start(int ctl, int threads) {
    for (int t = 0; t < threads; ++t) {
      ths.emplace_back([this, ctl, t] {
        for (int i = 0; !stop; ++i) {
          const int k = (t + i) % kPrompts;
          Reply r = SystemTest::Rollout(ctl, Prompt(8, k), kTokens);
          std::lock_guard<std::mutex> lock(mu);
          replies.emplace_back(k, std::move(r));
        }
      });
    }
  }
  void Stop() {
    stop = true;
    for (auto& t : ths) t.join();
    ths.clear();
  }
};

TEST_F(ReplicasTest, EightReplicasUpdateTwoAtATimeWhileRolloutsNeverStop) {
  const int dir = StartDirectory();
  v0_dir_ = dir_ + "/v0";
  Export("v0", v0_dir_);
  std::vector<int> ports(kReplicas);
  std::vector<ChildProcess*> procs(kReplicas);
  for (int i = 0; i < kReplicas; ++i) ports[i] = StartReplica(i, &procs[i]);
  ChildProcess* trainer = nullptr;
  const int trainer_port = StartTrainer(dir, "shm", &trainer);
  Json v0 = WaitCommitted(dir, "v0");
  std::string engines;
  // (Appended piece by piece: GCC 12 at -O3 reports a false -Wrestrict for "literal" + std::string, GCC PR 105329.)
  for (int p : ports) {
    if (!engines.empty()) engines += ',';
    engines += Url(p);
  }
  const int ctl = apps::FreePort().value();
  ChildProcess* c = Start("controller", {"controller", "serve", "--engine", engines, "--directory", Url(dir), "--model",
                                         system_test::kModelName, "--state-dir", dir_ + "/controller", "--port",
                                         std::to_string(ctl), "--max-updating", std::to_string(kMaxUpdating),
                                         "--install-deadline-ms", "4000", "--verify-interval-ms", "0"});
  ASSERT_TRUE(WaitHealthy(c, ctl, "/health"));
  auto all_ready = [&](const std::string& label) {
    const int64_t end = NowMs() + 60000;
    while (NowMs() < end) {
      auto es = Engines(ctl);
      int ok = 0;
      for (const auto& e : es)
        ok += e.value("state", std::string()) == "READY" && e.value("label", std::string()) == label;
      if (ok == kReplicas) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return false;
  };
  ASSERT_TRUE(all_ready("v0"));

  // Greedy references per prompt and version, straight on replica 0 (and one more for v1 later).
  std::map<std::string, std::vector<std::vector<int64_t>>> ref;
  for (int k = 0; k < kPrompts; ++k) ref["v0"].push_back(Tokens(Complete(ports[0], Prompt(8, k), kTokens)));

  system_test::Stack stack;
  stack.dir = dir;
  stack.trainer = trainer_port;
  Json v1 = Step(stack, "v1");
  ReadySampler sampler;
  RolloutLoad load;
  sampler.Start(ctl);
  load.Start(ctl, 2);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // rollouts running before the update
  const int64_t t_update = NowMs();
  Json update = WaitUpdate(ctl, RequestUpdate(ctl, "v1"), 120000);
  const int64_t update_ms = NowMs() - t_update;
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // and after it
  load.Stop();
  sampler.Stop();

  ASSERT_EQ(update["engines"].size(), static_cast<size_t>(kReplicas)) << update.dump();
  for (const auto& e : update["engines"]) EXPECT_EQ(e.value("outcome", std::string()), "committed") << e.dump();
  EXPECT_GT(sampler.samples.load(), 20) << "the sampler must have seen the update";
  EXPECT_GE(sampler.min_ready.load(), kReplicas - kMaxUpdating) << "never more than --max-updating out of READY";
  EXPECT_GE(sampler.max_out.load(), 1) << "the sampler must have seen replicas updating";
  Figure("min_ready_of_8", sampler.min_ready.load(), "replicas");
  Figure("ready_samples", sampler.samples.load(), "samples");
  Figure("update_8_replicas_ms", update_ms);
  ASSERT_TRUE(all_ready("v1"));
  for (int k = 0; k < kPrompts; ++k) ref["v1"].push_back(Tokens(Complete(ports[kReplicas - 1], Prompt(8, k), kTokens)));
  for (int k = 0; k < kPrompts; ++k) EXPECT_NE(ref["v0"][k], ref["v1"][k]) << "the versions must be told apart";

  // Rollouts never stopped, and each is bound to what its replica served.
  std::map<std::string, int> by_label;
  std::set<std::string> engines_used;
  for (const auto& [k, r] : load.replies) {
    ASSERT_EQ(r.status, 200) << "a rollout failed during the update: " << r.text;
    const std::string label = r.json["binding"].value("label", std::string());
    ASSERT_TRUE(ref.count(label)) << r.text;
    EXPECT_EQ(r.json["choices"][0].value("weight_version", std::string()), label) << r.text;
    EXPECT_EQ(Tokens(r.json), ref[label][k]) << "output of " << label << " for prompt " << k;
    ++by_label[label];
    engines_used.insert(r.json["binding"].value("engine", std::string()));
  }
  EXPECT_GT(by_label["v0"], 0);
  EXPECT_GT(by_label["v1"], 0);
  Figure("rollouts_during_update", static_cast<int64_t>(load.replies.size()), "rollouts");
  // The stored trajectories agree with the answers.
  for (const Json& t : Trajectories(ctl, "")) {
    const std::string label = t["binding"].value("label", std::string());
    ASSERT_TRUE(ref.count(label)) << t.dump();
    const auto prompt = t.value("prompt_token_ids", std::vector<int64_t>());
    int k = -1;
    for (int j = 0; j < kPrompts; ++j) {
      if (prompt == Prompt(8, j)) k = j;
    }
    ASSERT_GE(k, 0) << t.dump();
    EXPECT_EQ(t.value("output_token_ids", std::vector<int64_t>()), ref[label][k]) << t.dump();
    EXPECT_EQ(t.value("engine_weight_version", std::string()), label) << "served by what it was bound to: " << t.dump();
  }
  // Every replica is on v1, byte for byte.
  for (int i = 0; i < kReplicas; ++i) EXPECT_EQ(LiveDigest(ports[i]), v1["content_digest"]) << "replica " << i;

  // Next version; replica 5 is killed mid-install: TAINTED alone, the others commit.
  constexpr int kVictim = 5;
  Json v2 = Step(stack, "v2");
  SetFaults(ports[kVictim], Json{{"install_delay_ms", 20000}});
  const std::string id = RequestUpdate(ctl, "v2");
  const int64_t end = NowMs() + 60000;
  bool killed = false;
  while (NowMs() < end && !killed) {
    auto es = Engines(ctl);
    if (es.size() == kReplicas && es[kVictim].value("state", std::string()) == "UPDATING") {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));  // its install call is in flight
      procs[kVictim]->Kill();
      killed = true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_TRUE(killed) << "replica " << kVictim << " never reached UPDATING";
  Json done = WaitUpdate(ctl, id, 120000);
  ASSERT_EQ(done["engines"].size(), static_cast<size_t>(kReplicas)) << done.dump();
  auto es = Engines(ctl);
  ASSERT_EQ(es.size(), static_cast<size_t>(kReplicas));
  for (int i = 0; i < kReplicas; ++i) {
    const Json& e = done["engines"][i];
    if (i == kVictim) {
      EXPECT_EQ(e.value("outcome", std::string()), "tainted") << e.dump();
      EXPECT_EQ(es[i].value("state", std::string()), "TAINTED");
    } else {
      EXPECT_EQ(e.value("outcome", std::string()), "committed") << "replica " << i << ": " << e.dump();
      EXPECT_EQ(es[i].value("state", std::string()), "READY") << "replica " << i;
      EXPECT_EQ(es[i].value("label", std::string()), "v2") << "replica " << i;
      EXPECT_EQ(LiveDigest(ports[i]), v2["content_digest"]) << "replica " << i;
    }
  }
  Reply r = Rollout(ctl, Prompt(8, 0), kTokens);
  EXPECT_EQ(r.status, 200) << "seven replicas still serve: " << r.text;
  EXPECT_EQ(r.json["binding"].value("label", std::string()), "v2");
}

}  // namespace
}  // namespace rc::scale_test
