// EtcdCluster: a real 3-member (or n-member) etcd cluster on loopback for the scale tests
// (tests/scale/). Debian's etcd-server binary (/usr/bin/etcd), free loopback ports, one data dir
// per member under the test's folder, fast heartbeats (50 ms, election timeout 500 ms) so a new
// leader is elected within about a second of a kill.
//
// The leader is found through etcd's maintenance status API (POST /v3/maintenance/status on
// each member: the member whose header.member_id equals the reported leader). Members can be
// killed (SIGKILL), restarted over their data dir (they rejoin), or frozen (SIGSTOP: a member
// cut off from the others and from clients, a minority partition) and thawed.
//
// Thread safety: owned and driven by the test's thread; Leader() and Endpoints() only do HTTP.
#pragma once

#include <gtest/gtest.h>
#include <httplib.h>

#include <chrono>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "apps/child_process.h"
#include "rolloutcore/base/json.h"

namespace rc::scale_test {

class EtcdCluster {
 public:
  static constexpr const char* kBinary = "/usr/bin/etcd";
  static bool Installed() { return std::filesystem::exists(kBinary); }

  // Starts `n` members under `dir` and waits until every member is healthy (a leader exists).
  // FreePort's port is free when asked, not when etcd binds it: another test running in parallel
  // may take it in between. A start that failed that way ("address already in use") is torn down
  // and tried again on fresh ports, up to 4 times.
  ::testing::AssertionResult Start(const std::string& dir, int n = 3) {
    ::testing::AssertionResult r = ::testing::AssertionFailure();
    for (int attempt = 0; attempt < 4; ++attempt) {
      r = StartOnce(dir, n);
      if (r || std::string(r.message()).find("address already in use") == std::string::npos) return r;
      for (auto& m : members_) m.proc.reset();
      members_.clear();
      std::filesystem::remove_all(dir);
    }
    return r;
  }

  // "http://a,http://b,http://c": what `--store etcd:` takes.
  std::string Endpoints() const {
    std::string out;
    for (size_t i = 0; i < members_.size(); ++i) out += (i ? "," : "") + members_[i].client_url;
    return out;
  }
  const std::string& ClientUrl(int i) const { return members_[i].client_url; }
  int size() const { return static_cast<int>(members_.size()); }

  // POST /v3/maintenance/status on member i: {member_id, leader} as decimal strings.
  std::optional<std::pair<std::string, std::string>> MemberStatus(int i) const {
    httplib::Client c(members_[i].client_url);
    c.set_connection_timeout(0, 300'000);
    c.set_read_timeout(1, 0);
    auto r = c.Post("/v3/maintenance/status", "{}", "application/json");
    if (!r || r->status != 200) return std::nullopt;
    auto j = ParseJson(r->body);
    if (!j.ok() || !j->contains("header") || !j->contains("leader")) return std::nullopt;
    const Json& h = (*j)["header"];
    auto str = [](const Json& v) { return v.is_string() ? v.get<std::string>() : v.dump(); };
    if (!h.contains("member_id")) return std::nullopt;
    return std::make_pair(str(h["member_id"]), str((*j)["leader"]));
  }

  // The index of the current leader (asked of the live members), waiting up to timeout_ms for
  // the members that answer to agree on one that is alive; -1 when none.
  int Leader(int64_t timeout_ms = 10000) const {
    const auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
    while (std::chrono::steady_clock::now() < end) {
      for (int i = 0; i < size(); ++i) {
        if (!members_[i].proc || members_[i].frozen) continue;
        auto s = MemberStatus(i);
        if (s && s->first == s->second && s->second != "0") return i;  // it says it leads
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return -1;
  }

  void Kill(int i) {
    members_[i].proc->Kill();
    members_[i].proc->Alive();  // reap
    members_[i].proc.reset();
  }
  // Starts a killed member again over its data dir: it rejoins the cluster.
  ::testing::AssertionResult Restart(int i) {
    if (auto r = Spawn(i, "existing"); !r) return r;
    return WaitHealthy(i, 30000);
  }
  ::testing::AssertionResult Freeze(int i) {
    Status s = members_[i].proc->Freeze();
    if (!s.ok()) return ::testing::AssertionFailure() << s.ToString();
    members_[i].frozen = true;
    return ::testing::AssertionSuccess();
  }
  void Thaw(int i) {
    members_[i].proc->Thaw();
    members_[i].frozen = false;
  }

  ::testing::AssertionResult WaitHealthy(int i, int64_t timeout_ms) const {
    const auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
    while (std::chrono::steady_clock::now() < end) {
      if (!members_[i].proc || !members_[i].proc->Alive()) {
        return ::testing::AssertionFailure() << members_[i].name << " is not running:\n"
                                             << (members_[i].proc ? members_[i].proc->LogTail() : "");
      }
      httplib::Client c(members_[i].client_url);
      c.set_connection_timeout(0, 300'000);
      auto r = c.Get("/health");
      if (r && r->status == 200 && r->body.find("true") != std::string::npos) return ::testing::AssertionSuccess();
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return ::testing::AssertionFailure() << members_[i].name << " not healthy within " << timeout_ms << " ms:\n"
                                         << members_[i].proc->LogTail();
  }
  ::testing::AssertionResult WaitAllHealthy(int64_t timeout_ms) const {
    for (int i = 0; i < size(); ++i) {
      if (auto r = WaitHealthy(i, timeout_ms); !r) return r;
    }
    return ::testing::AssertionSuccess();
  }

  ~EtcdCluster() {
    for (auto& m : members_) {
      if (m.proc && m.frozen) m.proc->Thaw();
      m.proc.reset();  // SIGTERM, then SIGKILL
    }
  }

 private:
  struct Member {
    std::string name, client_url, peer_url, data_dir;
    std::unique_ptr<apps::ChildProcess> proc;
    bool frozen = false;
  };

  ::testing::AssertionResult StartOnce(const std::string& dir, int n) {
    dir_ = dir;
    std::filesystem::create_directories(dir_);
    members_.resize(n);
    std::string initial;
    for (int i = 0; i < n; ++i) {
      Member& m = members_[i];
      m.name = "etcd" + std::to_string(i);
      m.client_url = "http://127.0.0.1:" + std::to_string(apps::FreePort().value());
      m.peer_url = "http://127.0.0.1:" + std::to_string(apps::FreePort().value());
      m.data_dir = dir_ + "/" + m.name + ".data";
      initial += (i ? "," : "") + m.name + "=" + m.peer_url;
    }
    initial_cluster_ = initial;
    for (int i = 0; i < n; ++i) {
      if (auto r = Spawn(i, "new"); !r) return r;
    }
    return WaitAllHealthy(30000);
  }

  ::testing::AssertionResult Spawn(int i, const std::string& state) {
    Member& m = members_[i];
    auto c = apps::ChildProcess::Spawn(m.name,
                                       {"--name",
                                        m.name,
                                        "--data-dir",
                                        m.data_dir,
                                        "--listen-client-urls",
                                        m.client_url,
                                        "--advertise-client-urls",
                                        m.client_url,
                                        "--listen-peer-urls",
                                        m.peer_url,
                                        "--initial-advertise-peer-urls",
                                        m.peer_url,
                                        "--initial-cluster",
                                        initial_cluster_,
                                        "--initial-cluster-state",
                                        state,
                                        "--initial-cluster-token",
                                        "rc-scale-test",
                                        "--heartbeat-interval",
                                        "50",
                                        "--election-timeout",
                                        "500",
                                        "--log-level",
                                        "warn"},
                                       dir_ + "/" + m.name + ".log", kBinary);
    if (!c.ok()) return ::testing::AssertionFailure() << c.status().ToString();
    m.proc = std::move(c).value();
    return ::testing::AssertionSuccess();
  }

  std::string dir_;
  std::string initial_cluster_;
  std::vector<Member> members_;
};

}  // namespace rc::scale_test
