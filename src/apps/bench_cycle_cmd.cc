// `rolloutcore bench cycle` and `rolloutcore bench restart`: a hot update cycle through the
// controller against restarting the engine process on the same version.
//
// cycle: a directory and a 2-rank synthetic trainer (shm) run as child processes; the engine runs
// embedded in this process (EmbeddedEngine, dummy weights of the model's geometry) under a real
// ControllerService with the embedded adapter and a SQLite journal. For each cycle the trainer
// publishes the next version, the controller updates the engine to it (drain, prefetch stage,
// pause, install, cache reset, label + digest validation, resume), and the bench reads the
// update record: cycle time (request to committed), pause window (QUIESCED..RESUMING), drain,
// wire and install, and the controller overhead = cycle − (drain + stage + install + digest
// validation): what the lifecycle itself costs beyond moving and proving the bytes. The issue's
// "cycle minus drain, wire and install" is printed too. The trainer attaches --probes replay probes
// (default 2 x 8 tokens) to every version, and the report gives the replay's cost inside the pause
// window (engine time, and the Runner's wall time) and, separately, the pre-replay: the same probes
// run on the staged image inside the stage call, before the pause (docs/engine.md "Pre-replay on
// the staged image"), whose results VALIDATING then serves (replay evidence `precomputed`).
//
// Every adapter call is timed (call ->
// evidence) by a wrapper that leaves the Runner's Pending untouched, so the pause window is split
// into its parts (pause, install with its live digest, each cache reset, label and digest
// validation, resume, and the controller's time between those calls) and the controller overhead
// into per-phase parts (phase time outside the phase's engine calls, plus time outside phases).
//
// restart: the same version exported to disk (`trainer export`), then `engine serve --model DIR`
// started cold until it answers a first completion, --restarts times.
//
// `bench cycle` runs both and prints the ratio restart / cycle; `bench restart` only the restart.
//
// `bench cycle --engine vllm [ARGS...]`: the same comparison against a real vLLM 0.26 on a GPU
// machine, driven by the package's Python bench (python/rolloutcore/vllm_bench.py; it needs
// torch and vLLM, which this binary does not link): this process execs
// `$RC_PYTHON -m rolloutcore.vllm_bench [--cycles N] ARGS...` (RC_PYTHON defaults to python3;
// the package must be importable, e.g. PYTHONPATH), with ROLLOUTCORE_BIN set to this binary.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <iostream>
#include <map>
#include <mutex>
#include <optional>
#include <thread>

#include "rolloutcore/base/mutex.h"
#include "rolloutcore/base/pending.h"
#include "apps/bench_util.h"
#include "apps/child_process.h"
#include "apps/commands.h"
#include "rolloutcore/adapters/embedded_adapter.h"
#include "rolloutcore/controller/directory_versions.h"
#include "rolloutcore/controller/service.h"
#include "rolloutcore/directory/client.h"

namespace rc::apps {
namespace {

struct BenchCycleOptions {
  std::string model = "tiny";  // refit preset of the trainer
  int cycles = 3;
  int restarts = 2;
  int tp = 1;
  bool json = false;
  std::string engine = "embedded";  // cycle only: embedded | vllm
  int probes = 2;        // replay probes per version (docs/lifecycle.md "Replay validation")
  int probe_tokens = 8;
  bool trace = false;  // each cycle's timeline: engine calls and journal commits, ms from the request
};

// Replaces this process with the vLLM bench (see the header). Returns only when exec failed.
int ExecVllmBench(const BenchCycleOptions& o, bool cycles_given, const std::vector<std::string>& extra) {
  std::vector<std::string> args;
  if (cycles_given) {
    args.push_back("--cycles");
    args.push_back(std::to_string(o.cycles));
  }
  args.insert(args.end(), extra.begin(), extra.end());
  return ExecPythonModule("rolloutcore.vllm_bench", args, "bench cycle --engine vllm",
                          "torch, vLLM 0.26 or 0.33 and this package");
}

std::string EngineModelFor(const std::string& model) { return model == "qwen3-0.6b" ? "qwen3-0.6b-like" : model; }

double Ms(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double Num(const Json& j, std::initializer_list<const char*> path) {
  const Json* cur = &j;
  for (const char* k : path) {
    if (!cur->is_object() || !cur->contains(k)) return 0;
    cur = &(*cur)[k];
  }
  return cur->is_number() ? cur->get<double>() : 0;
}

// Every adapter call the controller makes, as an interval (call -> evidence) on the steady clock:
// from before the adapter's method is entered (an embedded adapter may do part of the work on the
// caller's thread before it returns its Pending) to a Pending::OnReady callback on the thread that
// fulfills it, just before the answer is published. The Runner gets the adapter's own Pending
// untouched and no thread waits on it (a watcher per call competed with the calls it timed on
// 2 cores, and one started after the method returned missed what ran inside it). Used to split
// the pause window into its parts and to say where the controller's own time goes: the gaps of a
// cycle in which no engine call is in flight, each named by the call before and the call after.
struct CallInterval {
  std::string name;
  std::chrono::steady_clock::time_point start, end;
};

class CallTimes {
 public:
  void Record(CallInterval c) {
    rc::MutexLock l(mu_);
    calls_.push_back(std::move(c));
  }
  // Calls that completed since the last Take() (a call still running is recorded when it ends).
  std::vector<CallInterval> Take() {
    rc::MutexLock l(mu_);
    std::vector<CallInterval> out;
    out.swap(calls_);
    return out;
  }

 private:
  rc::Mutex mu_;
  std::vector<CallInterval> calls_ GUARDED_BY(mu_);  // guarded by mu_
};

// Wall ms by call name (calls of one name summed).
std::map<std::string, double> CallMs(const std::vector<CallInterval>& calls) {
  std::map<std::string, double> out;
  for (const auto& c : calls) out[c.name] += std::chrono::duration<double, std::milli>(c.end - c.start).count();
  return out;
}

// The cycle [t0, t1] minus the union of the call intervals: each gap in which no adapter call
// was in flight, named "<call that ended it began>-><next call>" ("request->" at the start,
// "->committed" at the end), summed by name. What the controller did there: journal appends,
// noticing that a call completed (polling), deciding, and handing the next call to the adapter.
Json IdleGaps(std::vector<CallInterval> calls, std::chrono::steady_clock::time_point t0,
              std::chrono::steady_clock::time_point t1, double* idle_total) {
  std::sort(calls.begin(), calls.end(), [](const CallInterval& a, const CallInterval& b) { return a.start < b.start; });
  Json gaps = Json::object();
  auto cur_end = t0;
  std::string last = "request";
  *idle_total = 0;
  auto add = [&](const std::string& next, std::chrono::steady_clock::time_point until) {
    const double ms = std::chrono::duration<double, std::milli>(until - cur_end).count();
    if (ms <= 0) return;
    const std::string key = last + "->" + next;
    gaps[key] = gaps.value(key, 0.0) + ms;
    *idle_total += ms;
  };
  for (const auto& c : calls) {
    if (c.start > cur_end) add(c.name, c.start);
    if (c.end > cur_end) {
      cur_end = c.end;
      last = c.name;
    }
  }
  if (t1 > cur_end) add("committed", t1);
  return gaps;
}

// The union of call intervals as disjoint [start, end) pieces in time order, and how much of
// [s, e) those pieces cover.
using TimePoint = std::chrono::steady_clock::time_point;
std::vector<std::pair<TimePoint, TimePoint>> BusyPieces(std::vector<CallInterval> calls) {
  std::sort(calls.begin(), calls.end(), [](const CallInterval& a, const CallInterval& b) { return a.start < b.start; });
  std::vector<std::pair<TimePoint, TimePoint>> busy;
  for (const auto& c : calls) {
    if (!busy.empty() && c.start <= busy.back().second) {
      busy.back().second = std::max(busy.back().second, c.end);
    } else {
      busy.emplace_back(c.start, c.end);
    }
  }
  return busy;
}
double CoveredMs(const std::vector<std::pair<TimePoint, TimePoint>>& busy, TimePoint s, TimePoint e) {
  double covered = 0;
  for (const auto& [bs, be] : busy) {
    const auto os = std::max(s, bs), oe = std::min(e, be);
    if (oe > os) covered += std::chrono::duration<double, std::milli>(oe - os).count();
  }
  return covered;
}

// The journal commits of one cycle against its engine calls: the commit time spent while no
// engine call was in flight (what the cycle waited for), and how many commits were mostly there.
// A commit that overlaps a call in flight (the request's sync while the stage runs) costs the
// cycle nothing beyond that call.
struct JournalInGaps {
  double ms = 0;
  int64_t commits = 0;
};
JournalInGaps JournalOutsideCalls(const std::vector<lifecycle::JournalAppendInterval>& appends,
                                  const std::vector<CallInterval>& calls, TimePoint t0, TimePoint t1) {
  const auto busy = BusyPieces(calls);
  JournalInGaps out;
  for (const auto& a : appends) {
    const auto s = std::max(a.start, t0), e = std::min(a.end, t1);
    if (e <= s) continue;
    const double len = std::chrono::duration<double, std::milli>(e - s).count(), covered = CoveredMs(busy, s, e);
    out.ms += len - covered;
    if (len - covered > covered) ++out.commits;
  }
  return out;
}

// Length of the union of the intervals of the calls named in `names`.
double UnionMs(const std::vector<CallInterval>& calls, std::initializer_list<const char*> names) {
  std::vector<CallInterval> sel;
  for (auto& c : calls) {
    for (const char* n : names) {
      if (c.name == n) sel.push_back(c);
    }
  }
  double ms = 0;
  for (const auto& [s, e] : BusyPieces(std::move(sel))) ms += std::chrono::duration<double, std::milli>(e - s).count();
  return ms;
}

// The pause window measured on the adapter calls (the first pause call's start to the last resume
// call's end; the phase times are whole ms) and how much of it no engine call covered: the union
// of the calls inside it is subtracted, not their sum (the prefix reset and the digest read run
// at the same time). Both 0 when the cycle has no pause or no resume call.
struct PauseGaps {
  double window_ms = 0;
  double between_ms = 0;
};
PauseGaps PauseWindowGaps(const std::vector<CallInterval>& calls) {
  std::optional<TimePoint> a, b;
  for (const auto& c : calls) {
    if (c.name == "pause" && (!a || c.start < *a)) a = c.start;
    if (c.name == "resume" && (!b || c.end > *b)) b = c.end;
  }
  PauseGaps out;
  if (!a || !b || *b <= *a) return out;
  out.window_ms = std::chrono::duration<double, std::milli>(*b - *a).count();
  out.between_ms = std::max(0.0, out.window_ms - CoveredMs(BusyPieces(calls), *a, *b));
  return out;
}

class TimedAdapter final : public lifecycle::EngineAdapter {
 public:
  TimedAdapter(std::unique_ptr<lifecycle::EngineAdapter> inner, std::shared_ptr<CallTimes> times)
      : inner_(std::move(inner)), times_(std::move(times)) {}
  Result<lifecycle::EngineDescription> Describe() override { return inner_->Describe(); }
  Pending<lifecycle::DrainStatus> GetDrainStatus() override {
    return Watch("drain_status", [&] { return inner_->GetDrainStatus(); });
  }
  Pending<lifecycle::PauseEvidence> Pause(lifecycle::PauseMode m) override {
    return Watch("pause", [&] { return inner_->Pause(m); });
  }
  Pending<lifecycle::AbortEvidence> AbortRequests(const std::vector<std::string>& ids) override {
    return Watch("abort", [&] { return inner_->AbortRequests(ids); });
  }
  Pending<lifecycle::StageEvidence> Stage(const lifecycle::UpdateTarget& t) override {
    return Watch("stage", [&] { return inner_->Stage(t); });
  }
  Pending<lifecycle::InstallEvidence> Install(const lifecycle::UpdateTarget& t, bool full) override {
    return Watch("install", [&] { return inner_->Install(t, full); });
  }
  Pending<lifecycle::CacheResetResult> ResetCache(lifecycle::CacheKind k) override {
    return Watch("reset_" + std::string(lifecycle::CacheKindName(k)), [&] { return inner_->ResetCache(k); });
  }
  Pending<lifecycle::LabelEvidence> ReadLabel() override {
    return Watch("read_label", [&] { return inner_->ReadLabel(); });
  }
  Pending<lifecycle::DigestEvidence> ReadContentDigest() override {
    return Watch("read_digest", [&] { return inner_->ReadContentDigest(); });
  }
  Pending<lifecycle::ResumeEvidence> Resume() override {
    return Watch("resume", [&] { return inner_->Resume(); });
  }
  Pending<lifecycle::IdentityEvidence> ProbeIdentity() override {
    return Watch("probe_identity", [&] { return inner_->ProbeIdentity(); });
  }
  // The policy-mode and replay calls too: a wrapper that answered them with the base class's
  // Unimplemented tainted every update whose version carries replay probes (the default).
  Status SupportsPolicyMode(lifecycle::PolicyMode m) override { return inner_->SupportsPolicyMode(m); }
  Pending<lifecycle::PauseEvidence> PauseForUpdate(lifecycle::PolicyMode m) override {
    return Watch("pause", [&] { return inner_->PauseForUpdate(m); });
  }
  Pending<lifecycle::ReplayEvidence> Replay(const lifecycle::ReplayRequest& r) override {
    return Watch("replay", [&] { return inner_->Replay(r); });
  }

 private:
  // Calls `call` (the inner adapter's method) and times it: from before it is entered to the
  // fulfilment of its Pending (OnReady: quick, never blocks, holds no copy of the Pending).
  template <typename Call>
  auto Watch(std::string name, Call&& call) -> decltype(call()) {
    const auto t0 = std::chrono::steady_clock::now();
    auto p = call();
    p.OnReady([t0, name = std::move(name), times = times_] {
      times->Record({name, t0, std::chrono::steady_clock::now()});
    });
    return p;
  }
  std::unique_ptr<lifecycle::EngineAdapter> inner_;
  std::shared_ptr<CallTimes> times_;
};

// The directory lookups of RequestUpdate (the version's info and its probes: HTTP round trips to
// the directory), timed: part of the cycle before the first engine call.
class TimedVersionSource final : public controller::VersionSource {
 public:
  explicit TimedVersionSource(controller::VersionSource* inner) : inner_(inner) {}
  Result<lifecycle::UpdateTarget> Resolve(const std::string& model, const std::string& version) override {
    const auto t0 = std::chrono::steady_clock::now();
    auto r = inner_->Resolve(model, version);
    last_ms_ = Ms(t0);
    return r;
  }
  Result<std::vector<Commit>> WaitForCommits(const std::string& model, uint64_t after_seq, int64_t timeout_ms) override {
    return inner_->WaitForCommits(model, after_seq, timeout_ms);
  }
  double last_ms() const { return last_ms_; }

 private:
  controller::VersionSource* inner_;
  std::atomic<double> last_ms_{0};
};

// The state dir's filesystem: median wall time of an fdatasync after overwriting one 4 KiB block
// (what one journal commit into the reserved WAL costs the disk), over `n` syncs. Measured before
// and after the cycles, so the journal part of the overhead can be read against the disk of the
// moment: the journal's share is (commits on the critical path) x this.
double FdatasyncMs(const std::string& dir, int n = 20) {
  const std::string path = dir + "/fdatasync-probe";
  int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) return -1;
  std::vector<char> block(4096, 0);
  std::vector<double> ms;
  bool ok = ::pwrite(fd, block.data(), block.size(), 0) == static_cast<ssize_t>(block.size()) && ::fsync(fd) == 0;
  for (int i = 0; ok && i < n; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    ok = ::pwrite(fd, block.data(), block.size(), 0) == static_cast<ssize_t>(block.size()) && ::fdatasync(fd) == 0;
    ms.push_back(Ms(t0));
  }
  ::close(fd);
  ::unlink(path.c_str());
  return ok ? Median(ms) : -1;
}

struct Stack {
  std::string dir;
  int dir_port = 0, trainer_port = 0;
  std::unique_ptr<ChildProcess> directory, trainer;
  std::string dir_url() const { return "http://127.0.0.1:" + std::to_string(dir_port); }
};

Result<Stack> StartStack(const BenchCycleOptions& o, const std::string& what) {
  Stack s;
  char tmpl[] = "/tmp/rolloutcore-bench-cycle-XXXXXX";
  s.dir = mkdtemp(tmpl);
  RC_ASSIGN_OR_RETURN(s.dir_port, FreePort());
  RC_ASSIGN_OR_RETURN(s.trainer_port, FreePort());
  auto log = [&](const std::string& n) { return s.dir + "/" + n + ".log"; };
  std::cerr << "bench " << what << ": work dir " << s.dir << "\n";
  RC_ASSIGN_OR_RETURN(s.directory, ChildProcess::Spawn("directory", {"directory", "serve", "--store", "memory",
                                                                     "--port", std::to_string(s.dir_port)},
                                                       log("directory")));
  RC_RETURN_IF_ERROR(BenchWaitHealthy(s.directory.get(), s.dir_port, "/health", 30));
  RC_ASSIGN_OR_RETURN(s.trainer, ChildProcess::Spawn("trainer", {"trainer", "serve", "--model", o.model, "--name", "bench",
                                                                 "--layout", "fsdp:2", "--directory", s.dir_url(),
                                                                 "--transport", "shm", "--keep", "2", "--probes",
                                                                 std::to_string(o.probes), "--probe-tokens",
                                                                 std::to_string(o.probe_tokens), "--port",
                                                                 std::to_string(s.trainer_port)},
                                                     log("trainer")));
  RC_RETURN_IF_ERROR(BenchWaitHealthy(s.trainer.get(), s.trainer_port, "/status", 600));
  return s;
}

// One update of `bench cycle`: the trainer's next version, requested through the controller and
// waited for, with the engine calls and the journal commits of its cycle.
struct CycleRun {
  std::string version;
  Json done;  // the update record (WaitForUpdate)
  TimePoint t0, t1;  // the request, the committed update
  double total = 0;  // ms from t0 to the answer
  lifecycle::JournalAppendStats journal_before, journal_after;
  std::vector<CallInterval> intervals;  // the engine calls of the cycle (ended by t1)
};

Result<CycleRun> RunOneUpdate(const Stack& s, controller::ControllerService& svc, CallTimes& times) {
  CycleRun run;
  RC_ASSIGN_OR_RETURN(Json step, BenchCall(s.trainer_port, "POST", "/step"));
  run.version = step.value("version", "");
  if (step.value("state", "") != "COMMITTED") return Internal("trainer step did not commit: " + step.dump());
  (void)times.Take();  // identity probes between cycles are not this cycle's
  run.journal_before = svc.JournalAppendTotals();
  run.t0 = std::chrono::steady_clock::now();
  RC_ASSIGN_OR_RETURN(std::string id, svc.RequestUpdate("bench", run.version));
  RC_ASSIGN_OR_RETURN(run.done, svc.WaitForUpdate(id, 1'200'000));
  run.t1 = std::chrono::steady_clock::now();
  run.total = Ms(run.t0);
  run.journal_after = svc.JournalAppendTotals();
  std::this_thread::sleep_for(std::chrono::milliseconds(5));  // let the last watchers record
  run.intervals = times.Take();
  // Calls that ended after the cycle (none expected: WaitForUpdate waits for the identity
  // check) are not this cycle's.
  std::erase_if(run.intervals, [&](const CallInterval& c) { return c.end > run.t1; });
  return run;
}

// --trace: where the cycle's time went, call by call: each engine call (issued -> answer seen) and
// each journal commit (BEGIN -> synced COMMIT), in ms from the request.
void PrintCycleTrace(const CycleRun& run) {
  std::vector<std::tuple<double, double, std::string>> events;
  events.reserve(run.intervals.size() + run.journal_after.recent.size());
  auto rel = [&](std::chrono::steady_clock::time_point t) {
    return std::chrono::duration<double, std::milli>(t - run.t0).count();
  };
  for (const auto& c : run.intervals) events.emplace_back(rel(c.start), rel(c.end), c.name);
  for (const auto& a : run.journal_after.recent) {
    if (a.end > run.t0 && a.start < run.t1) events.emplace_back(rel(a.start), rel(a.end), "journal commit");
  }
  std::sort(events.begin(), events.end());
  std::cerr << fmt::format("  trace of {} (ms from the request):\n", run.version);
  for (const auto& [s0, s1, n] : events) std::cerr << fmt::format("    {:8.3f} .. {:8.3f}  {}\n", s0, s1, n);
  std::cerr << fmt::format("    {:8.3f}            committed\n", rel(run.t1));
}

// The pause window's parts: each engine call inside it, and what is left (the controller's
// journal writes and polling between the calls: the window on the call clock minus the
// union of the calls in it, PauseWindowGaps).
Json PauseWindowParts(const std::vector<CallInterval>& intervals, const std::map<std::string, double>& calls,
                      double install, double install_digest) {
  auto call = [&](const std::string& n) { return calls.count(n) ? calls.at(n) : 0.0; };
  Json pause_parts{{"pause_call", call("pause")},
                   {"install", install},
                   {"install_live_digest", install_digest},
                   {"install_call", call("install")},
                   {"validation_label", call("read_label")},
                   {"validation_digest", call("read_digest")},
                   {"validation_replay", call("replay")},
                   {"resume_call", call("resume")}};
  for (const auto& [n, ms] : calls) {
    if (n.rfind("reset_", 0) == 0) pause_parts["cache_" + n] = ms;
  }
  const PauseGaps pause_gaps = PauseWindowGaps(intervals);
  pause_parts["window_on_calls"] = pause_gaps.window_ms;
  pause_parts["controller_between_calls"] = pause_gaps.between_ms;
  return pause_parts;
}

// The report of one cycle (its "cycles" entry) from its update record, evidence and call times;
// prints its summary line. An update that did not commit, or committed without a matching replay,
// is an error.
Result<Json> CycleRecord(const BenchCycleOptions& o, CycleRun run, const TimedVersionSource& versions, bool cold) {
  const std::string& version = run.version;
  const std::vector<CallInterval>& intervals = run.intervals;
  const double total = run.total;
  const std::map<std::string, double> calls = CallMs(intervals);
  auto call = [&](const std::string& n) { return calls.count(n) ? calls.at(n) : 0.0; };
  const Json& e = run.done["engines"][0];
  if (e.value("outcome", "") != "committed") return Internal("update to " + version + " ended " + e.dump());
  const Json& ph = e["phases_ms"];
  double pause = 0;
  for (const char* p : {"QUIESCED", "UPDATING", "INVALIDATING", "VALIDATING", "RESUMING"}) pause += Num(ph, {p});
  const Json& ev = e.value("evidence", Json::object());
  const Json staged = ev.contains("staged") ? ev["staged"]["engine"] : Json::object();
  const Json installed = ev.contains("install_complete") ? ev["install_complete"].value("detail", Json::object()) : Json::object();
  const double drain = Num(ph, {"DRAINING"});
  const double stage = Num(staged, {"stages_ms", "total"});
  // Pre-replay (docs/lifecycle.md "Replay validation"): the probes replayed on the staged image
  // inside the stage call, while the old version still serves — outside the pause window.
  const Json prereplay = staged.value("prereplay", Json::object());
  const double prereplay_ms = Num(prereplay, {"ms"});
  const double wire = Num(staged, {"stages_ms", "wire"});
  if (o.trace && staged.contains("stages_ms")) {
    std::cerr << "  stage parts of " << version << " (ms, engine): " << staged["stages_ms"].dump() << "\n";
  }
  const double install = Num(installed, {"stages_ms", "install"});
  const double install_digest = Num(installed, {"stages_ms", "post_install"});
  // Validation: the engine's reads that prove the bytes (label, content digest, replay
  // probes), as the union of their call intervals (sub-ms; the phase times are whole ms).
  const double validate = UnionMs(intervals, {"read_label", "read_digest", "replay"});
  // Replay validation, inside VALIDATING (the pause window): the engine's own time for every
  // probe, and the Runner's wall time from the first replay call to the last answer (ms clock).
  const Json replay = ev.contains("validated") ? ev["validated"].value("replay", Json::object()) : Json::object();
  if (!replay.value("skipped", true) && !replay.value("match", false)) {
    return Internal("update to " + version + " committed without a matching replay: " + replay.dump());
  }
  const double replay_engine = Num(replay, {"engine_ms"});
  const double replay_wall = Num(replay, {"wall_ms"});
  // The bench runs no rollouts, so nothing holds the drain: time in DRAINING beyond the stage
  // (the drain-status round trip, journal appends) is the controller's, not a drain wait.
  const double drain_wait = 0;
  // Engine-side work: staging, install with its live digest, and the validation reads (the
  // engine's own times for stage and install). The rest of the cycle is the controller's own
  // cost: journal writes, noticing completions, pause/reset/resume round trips, the request
  // (directory resolve) and the identity check after the update.
  // The engine's whole stage and install calls where it reports them (`call_ms`: the receiver's
  // wall time from entry to return, which also holds its locks, the shadow's mprotect, the
  // evidence it builds and the pre-replay adoption); the named parts otherwise. What is left of
  // each call's interval is its dispatch: the adapter's hand-off to a worker and back.
  const double stage_engine = std::max(Num(staged, {"call_ms"}), stage + prereplay_ms);
  const double install_engine = std::max(Num(installed, {"call_ms"}), install + install_digest);
  const double overhead = total - stage_engine - drain_wait - install_engine - validate;
  // The same with only the named parts subtracted (the figure before 2026-12-02: the engine's
  // unnamed work inside its stage and install calls counted as the controller's).
  const double overhead_named = total - stage - prereplay_ms - drain_wait - install - install_digest - validate;
  const Json pause_parts = PauseWindowParts(intervals, calls, install, install_digest);
  // Controller overhead, split precisely: the gaps in which no engine call was in flight (by
  // the calls around them), the journal appends (count and time, all of them, and the part of
  // their time no engine call overlapped: what the cycle waited for; issue 15's group commits
  // sync the request while the stage runs),
  // and the controller-side engine calls (pause, resets, resume, drain status, identity probe)
  // plus each call's dispatch beyond the engine's own stage/install time.
  double idle = 0;
  Json gaps = IdleGaps(intervals, run.t0, run.t1, &idle);
  const double journal_ms = run.journal_after.append_ms - run.journal_before.append_ms;
  const int64_t journal_appends = run.journal_after.appends - run.journal_before.appends;
  const int64_t journal_syncs = run.journal_after.syncs - run.journal_before.syncs;
  const JournalInGaps journal_waited = JournalOutsideCalls(run.journal_after.recent, intervals, run.t0, run.t1);
  double resets = 0;
  for (const auto& [n, ms] : calls) resets += n.rfind("reset_", 0) == 0 ? ms : 0.0;
  Json overhead_parts{{"idle_gaps_total", idle},
                      {"directory_resolve", versions.last_ms()},
                      {"journal_records", journal_appends},
                      {"journal_commits", journal_syncs},
                      {"journal_append_ms", journal_ms},
                      {"journal_commits_waited_for", journal_waited.commits},
                      {"journal_waited_ms", journal_waited.ms},
                      {"idle_gaps_outside_journal", idle - journal_waited.ms},
                      {"pause_call", call("pause")},
                      {"reset_calls", resets},
                      {"resume_call", call("resume")},
                      {"drain_status_calls", UnionMs(intervals, {"drain_status"})},
                      {"identity_probe_calls", call("probe_identity")},
                      {"stage_engine_beyond_parts", stage_engine - stage - prereplay_ms},
                      {"install_engine_beyond_parts", install_engine - install - install_digest},
                      {"stage_call_beyond_engine", call("stage") - stage_engine},
                      {"install_call_beyond_engine", call("install") - install_engine}};
  Json c{{"version", version},
         {"cycle_ms", total},
         {"pause_window_ms", pause},
         {"drain_ms", drain},
         {"drain_wait_ms", drain_wait},
         {"stage_ms", stage},
         {"wire_ms", wire},
         {"install_ms", install},
         {"install_digest_ms", install_digest},
         {"validate_ms", validate},
         {"controller_overhead_ms", overhead},
         {"controller_overhead_named_parts_ms", overhead_named},
         {"cycle_minus_drain_wire_install_ms", total - drain - install},
         {"replay", replay},
         {"prereplay", prereplay},
         {"prereplay_ms", prereplay_ms},
         {"replay_engine_ms", replay_engine},
         {"replay_wall_ms", replay_wall},
         {"phases_ms", ph},
         {"pause_window_parts_ms", pause_parts},
         {"controller_overhead_parts_ms", overhead_parts},
         {"controller_idle_gaps_ms", gaps},
         {"calls_ms", calls},
         {"cold", cold}};
  std::cerr << fmt::format("bench cycle: {} {}: cycle {:.1f} ms, pause window {:.0f} ms, stage {:.1f} ms (wire {:.1f}), "
                           "pre-replay {:.1f} ms (stage, {}), install {:.1f} ms, replay {:.2f} ms (engine, in the "
                           "pause; {} of {} probes precomputed; {:.0f} ms wall), controller overhead {:.1f} ms\n",
                           version, cold ? "(cold, not counted)" : "", total, pause, stage, wire, prereplay_ms,
                           prereplay.value("ran", false) ? "ran" : "not run: " + prereplay.value("why", std::string()),
                           install, replay_engine, replay.value("precomputed", int64_t{0}),
                           replay.value("probes", int64_t{0}), replay_wall, overhead);
  std::cerr << "  pause window parts (ms): " << pause_parts.dump() << "\n  controller overhead parts (ms): "
            << overhead_parts.dump() << "\n  controller idle gaps (ms): " << gaps.dump() << "\n";
  return c;
}

// The warm cycles' figures (taken from their records), one series each, for the report's medians.
struct WarmCycleSeries {
  std::vector<double> cycle_ms, pause_ms, overhead_ms, overhead_named_ms, overhead_issue_ms, replay_engine_ms,
      replay_wall_ms, prereplay_ms;
  std::map<std::string, std::vector<double>> pause_part_ms, overhead_part_ms, gap_ms;

  void Add(const Json& c) {
    cycle_ms.push_back(c["cycle_ms"].get<double>());
    pause_ms.push_back(c["pause_window_ms"].get<double>());
    overhead_ms.push_back(c["controller_overhead_ms"].get<double>());
    overhead_named_ms.push_back(c["controller_overhead_named_parts_ms"].get<double>());
    overhead_issue_ms.push_back(c["cycle_minus_drain_wire_install_ms"].get<double>());
    replay_engine_ms.push_back(c["replay_engine_ms"].get<double>());
    prereplay_ms.push_back(c["prereplay_ms"].get<double>());
    replay_wall_ms.push_back(c["replay_wall_ms"].get<double>());
    for (const auto& [k, v] : c["pause_window_parts_ms"].items()) pause_part_ms[k].push_back(v.get<double>());
    for (const auto& [k, v] : c["controller_overhead_parts_ms"].items()) overhead_part_ms[k].push_back(v.get<double>());
    for (const auto& [k, v] : c["controller_idle_gaps_ms"].items()) gap_ms[k].push_back(v.get<double>());
  }
};

Result<Json> RunCycles(const BenchCycleOptions& o, Stack& s) {
  std::cerr << "bench cycle: embedded engine (" << EngineModelFor(o.model) << ", dummy weights, tp " << o.tp << ")\n";
  adapters::EmbeddedEngine::Options eo;
  eo.model = EngineModelFor(o.model);
  eo.load_format = "dummy";
  eo.tensor_parallel_size = o.tp;
  eo.weight_version = "init";
  RC_ASSIGN_OR_RETURN(auto engine, adapters::EmbeddedEngine::Create(eo));
  directory::DirectoryClient dir(s.dir_url());
  controller::DirectoryVersionSource dir_versions(&dir);
  TimedVersionSource versions(&dir_versions);
  std::vector<controller::EngineHandle> engines;
  controller::EngineHandle h;
  h.name = "embedded";
  auto times = std::make_shared<CallTimes>();
  h.adapter = std::make_unique<TimedAdapter>(engine->MakeAdapter({s.dir_url(), "bench"}), times);
  h.complete = engine->MakeCompleter();
  engines.push_back(std::move(h));
  controller::ServiceOptions so;
  so.state_dir = s.dir + "/controller";
  so.runner.deadlines.stage_ms = 600000;
  so.runner.deadlines.install_ms = 600000;
  so.runner.deadlines.validate_ms = 600000;
  so.runner.deadlines.pause_ms = 60000;
  so.runner.deadlines.reset_ms = 60000;
  so.runner.deadlines.resume_ms = 60000;
  RC_ASSIGN_OR_RETURN(auto svc, controller::ControllerService::Create(std::move(engines), &versions, so));

  const double fdatasync_before = FdatasyncMs(so.state_dir);
  Json cycles = Json::array();
  WarmCycleSeries warm;
  // One update more than reported: the first one allocates the shadow and staging (a cold refit).
  for (int i = 0; i <= o.cycles; ++i) {
    RC_ASSIGN_OR_RETURN(CycleRun run, RunOneUpdate(s, *svc, *times));
    if (o.trace) PrintCycleTrace(run);
    RC_ASSIGN_OR_RETURN(Json c, CycleRecord(o, std::move(run), versions, i == 0));
    cycles.push_back(c);
    if (i == 0) continue;
    warm.Add(c);
  }
  Json pause_parts_median = Json::object(), overhead_parts_median = Json::object();
  for (auto& [k, v] : warm.pause_part_ms) pause_parts_median[k] = Median(v);
  for (auto& [k, v] : warm.overhead_part_ms) overhead_parts_median[k] = Median(v);
  // A gap that some cycles did not have counts 0 there.
  Json gaps_median = Json::object();
  for (auto& [k, v] : warm.gap_ms) {
    v.resize(warm.cycle_ms.size(), 0.0);
    gaps_median[k] = Median(v);
  }
  const double fdatasync_after = FdatasyncMs(so.state_dir);
  // A rollout on the last version proves the engine serves it.
  RC_ASSIGN_OR_RETURN(Json r, svc->Rollout(Json{{"prompt_token_ids", {1, 2, 3, 4}}, {"max_tokens", 4}, {"temperature", 0.0}}));
  return Json{{"cycles", cycles},
              {"cycle_ms_median", Median(warm.cycle_ms)},
              {"pause_window_ms_median", Median(warm.pause_ms)},
              {"controller_overhead_ms_median", Median(warm.overhead_ms)},
              {"controller_overhead_named_parts_ms_median", Median(warm.overhead_named_ms)},
              {"pause_window_parts_ms_median", pause_parts_median},
              {"controller_overhead_parts_ms_median", overhead_parts_median},
              {"controller_idle_gaps_ms_median", gaps_median},
              {"state_dir_fdatasync_ms", {{"before", fdatasync_before}, {"after", fdatasync_after}}},
              {"cycle_minus_drain_wire_install_ms_median", Median(warm.overhead_issue_ms)},
              {"replay_probes", o.probes},
              {"replay_probe_tokens", o.probe_tokens},
              {"replay_engine_ms_median", Median(warm.replay_engine_ms)},
              {"prereplay_ms_median", Median(warm.prereplay_ms)},
              {"replay_wall_ms_median", Median(warm.replay_wall_ms)},
              {"served_label_after", r["binding"]["label"]}};
}

// `version`: the version the restart loads (the one the last cycle installed), exported to disk
// from the trainer's seed (W_k is reproducible).
Result<Json> RunRestarts(const BenchCycleOptions& o, Stack& s, const std::string& version) {
  const std::string out = s.dir + "/export-" + version;
  std::cerr << "bench restart: exporting " << version << " of " << o.model << " to " << out << "\n";
  auto t_export = std::chrono::steady_clock::now();
  RC_ASSIGN_OR_RETURN(auto ex, ChildProcess::Spawn("export", {"trainer", "export", "--model", o.model, "--version", version,
                                                              "--out", out},
                                                   s.dir + "/export.log"));
  while (ex->Alive()) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  if (int rc = ex->Stop(); rc != 0) return Internal("trainer export failed:\n" + ex->LogTail());
  const double export_ms = Ms(t_export);
  Json runs = Json::array();
  std::vector<double> ready_ms;
  for (int i = 0; i < o.restarts; ++i) {
    RC_ASSIGN_OR_RETURN(int port, FreePort());
    auto t0 = std::chrono::steady_clock::now();
    RC_ASSIGN_OR_RETURN(auto e, ChildProcess::Spawn("engine-restart",
                                                    {"engine", "serve", "--model", out, "--tensor-parallel-size",
                                                     std::to_string(o.tp), "--weight-version", version, "--port",
                                                     std::to_string(port)},
                                                    s.dir + "/engine-restart-" + std::to_string(i) + ".log"));
    RC_RETURN_IF_ERROR(BenchWaitHealthy(e.get(), port, "/health", 1200));
    const double healthy = Ms(t0);
    RC_ASSIGN_OR_RETURN(Json c, BenchCall(port, "POST", "/v1/completions",
                                          Json{{"prompt", {1, 2, 3, 4}}, {"max_tokens", 1}, {"temperature", 0.0}}));
    const double ready = Ms(t0);
    if (c["choices"][0].value("weight_version", "") != version) {
      return Internal("restarted engine serves " + c["choices"][0].value("weight_version", "?") + ", not " + version);
    }
    std::cerr << fmt::format("bench restart: {} cold start: healthy {:.1f} ms, first token {:.1f} ms\n", i + 1, healthy,
                             ready);
    runs.push_back(Json{{"healthy_ms", healthy}, {"ready_ms", ready}});
    ready_ms.push_back(ready);
    e->Stop();
  }
  return Json{{"version", version}, {"export_ms", export_ms}, {"runs", runs}, {"ready_ms_median", Median(ready_ms)}};
}

Status Run(const BenchCycleOptions& o, bool cycle) {
  RC_ASSIGN_OR_RETURN(Stack s, StartStack(o, cycle ? "cycle" : "restart"));
  Json report{{"model", o.model}, {"engine_model", EngineModelFor(o.model)}, {"tp", o.tp}};
  Status st = OkStatus();
  std::string version;
  if (cycle) {
    auto c = RunCycles(o, s);
    if (!c.ok()) st = c.status();
    if (c.ok()) {
      report["cycle"] = *c;
      version = (*c)["served_label_after"].get<std::string>();
    }
  } else {
    // Restart needs some committed version: publish one.
    auto step = BenchCall(s.trainer_port, "POST", "/step");
    if (!step.ok()) st = step.status();
    if (step.ok()) version = step->value("version", "");
  }
  if (st.ok()) {
    auto r = RunRestarts(o, s, version);
    if (!r.ok()) st = r.status();
    if (r.ok()) report["restart"] = *r;
  }
  StopAllChildren();
  RC_RETURN_IF_ERROR(st);
  if (cycle) {
    const double c = report["cycle"]["cycle_ms_median"].get<double>();
    const double r = report["restart"]["ready_ms_median"].get<double>();
    report["restart_over_cycle"] = c > 0 ? r / c : 0.0;
  }
  if (o.json) {
    std::cout << report.dump(2) << "\n";
  } else if (cycle) {
    const Json& c = report["cycle"];
    std::cout << fmt::format(
        "update cycle vs restart, {} (engine {}, tp {}), medians of {} warm cycles and {} restarts\n"
        "  hot update cycle      {:10.1f} ms   (pause window {:.1f} ms)\n"
        "  restart (cold->ready) {:10.1f} ms   (export to disk took {:.1f} ms more, not counted)\n"
        "  ratio restart/cycle   {:10.2f} x\n"
        "  controller overhead   {:10.2f} ms   (cycle - the engine's stage and install calls - validation reads;\n"
        "                                     {:.2f} ms subtracting only their named parts)\n"
        "  replay validation     {:10.2f} ms   ({} probes x {} tokens, engine time, in the pause window; Runner wall "
        "{:.0f} ms)\n"
        "  pre-replay (stage)    {:10.2f} ms   (the same probes on the staged image, while the old version serves)\n"
        "  pause window parts (medians, ms): {}\n"
        "  controller overhead parts (medians, ms): {}\n"
        "  controller idle gaps (medians, ms; no engine call in flight, by the calls around them): {}\n"
        "  state dir fdatasync (4 KiB overwrite, median of 20): {:.3f} ms before the cycles, {:.3f} ms after\n"
        "  cycle - drain - install: {:.1f} ms (the issue's 'cycle minus drain, wire and install'; wire runs inside\n"
        "    DRAINING as a prefetch, so it is already in drain; this still holds the pause/reset/validate work)\n",
        o.model, report["engine_model"].get<std::string>(), o.tp, o.cycles, o.restarts,
        c["cycle_ms_median"].get<double>(), c["pause_window_ms_median"].get<double>(),
        report["restart"]["ready_ms_median"].get<double>(), report["restart"]["export_ms"].get<double>(),
        report["restart_over_cycle"].get<double>(), c["controller_overhead_ms_median"].get<double>(),
        c["controller_overhead_named_parts_ms_median"].get<double>(),
        c["replay_engine_ms_median"].get<double>(), o.probes, o.probe_tokens, c["replay_wall_ms_median"].get<double>(),
        c["prereplay_ms_median"].get<double>(),
        c["pause_window_parts_ms_median"].dump(), c["controller_overhead_parts_ms_median"].dump(), c["controller_idle_gaps_ms_median"].dump(), c["state_dir_fdatasync_ms"]["before"].get<double>(),
        c["state_dir_fdatasync_ms"]["after"].get<double>(),
        c["cycle_minus_drain_wire_install_ms_median"].get<double>());
  } else {
    std::cout << fmt::format("restart {} (engine from disk, tp {}): cold start to first token {:.1f} ms (median of {})\n",
                             o.model, o.tp, report["restart"]["ready_ms_median"].get<double>(), o.restarts);
  }
  std::filesystem::remove_all(s.dir);
  return OkStatus();
}

CLI::App* BenchApp(CLI::App& app) {
  for (CLI::App* sub : app.get_subcommands([](CLI::App* a) { return a->get_name() == "bench"; })) return sub;
  CLI::App* bench = app.add_subcommand("bench", "Benchmarks.");
  bench->require_subcommand(1);
  return bench;
}

void AddCommon(CLI::App* cmd, BenchCycleOptions* o) {
  cmd->add_option("--model", o->model, "Preset: tiny or qwen3-0.6b (the ~0.5B one)")
      ->check(CLI::IsMember({"tiny", "tiny-llama", "tiny-qwen2", "qwen3-0.6b"}))
      ->capture_default_str();
  cmd->add_option("--tp", o->tp, "Engine tensor-parallel size")->check(CLI::Range(1, 1024))->capture_default_str();
  cmd->add_option("--restarts", o->restarts, "Cold restarts to time")->check(CLI::Range(1, 10000))->capture_default_str();
  cmd->add_flag("--json", o->json, "Print a JSON report instead of the table");
}

}  // namespace

void RegisterBenchCycleCommands(CLI::App& app, int* exit_code) {
  CLI::App* bench = BenchApp(app);
  auto o = std::make_shared<BenchCycleOptions>();
  auto* cycle = bench->add_subcommand(
      "cycle", "Hot update cycle through the controller (embedded engine) vs restarting the engine on the same version.");
  AddCommon(cycle, o.get());
  cycle->add_option("--probes", o->probes, "Replay probes the trainer attaches to every version (0: none)")
      ->check(CLI::Range(0, 16))
      ->capture_default_str();
  cycle->add_flag("--trace", o->trace,
                  "Print each cycle's timeline: every engine call and journal commit, ms from the request");
  cycle->add_option("--probe-tokens", o->probe_tokens, "Greedy tokens per probe")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  cycle->add_option("--cycles", o->cycles, "Warm update cycles to time (after one cold one)")
      ->check(CLI::Range(1, 100000))
      ->capture_default_str();
  cycle
      ->add_option("--engine", o->engine,
                   "embedded: the engine in this process (the flags here). vllm: a real vLLM 0.26 on this GPU "
                   "machine: execs `python3 -m rolloutcore.vllm_bench` (RC_PYTHON overrides python3) with --cycles "
                   "and every further argument (--shape tiny|0.6b|8b, --controller, --pause-call pause|sleep|both, "
                   "--no-restart, --dry-run, ...; `rolloutcore bench cycle --engine vllm --bench-help` lists them)")
      ->check(CLI::IsMember({"embedded", "vllm"}))
      ->capture_default_str();
  cycle->allow_extras();
  cycle->callback([o, exit_code, cycle] {
    std::vector<std::string> extra = cycle->remaining();
    if (o->engine == "vllm") {
      for (auto& a : extra) {
        if (a == "--bench-help") a = "--help";
      }
      *exit_code = ExecVllmBench(*o, cycle->count("--cycles") > 0, extra);
      return;
    }
    if (!extra.empty()) {
      std::cerr << "bench cycle: unknown arguments for --engine embedded: " << fmt::format("{}", fmt::join(extra, " "))
                << "\n";
      *exit_code = 2;
      return;
    }
    Status s = Run(*o, true);
    if (!s.ok()) std::cerr << "bench cycle: " << s.ToString() << "\n";
    *exit_code = s.ok() ? 0 : 1;
  });
  // bench publish: the trainer's side in Python (python/rolloutcore/publish_bench.py); every
  // argument, --help included, goes to it.
  auto* publish = bench->add_subcommand(
      "publish",
      "The trainer's publish over shm from Python: Publisher.add_shard(copy=True) into reused shared memory against "
      "fresh, alternated (execs `python3 -m rolloutcore.publish_bench`, RC_PYTHON overrides python3; "
      "`rolloutcore bench publish --help` lists its flags)");
  publish->set_help_flag();
  publish->allow_extras();
  publish->callback([exit_code, publish] {
    *exit_code = ExecPythonModule("rolloutcore.publish_bench", publish->remaining(), "bench publish",
                                  "numpy and this package (torch for --source torch|cuda)");
  });
  auto r = std::make_shared<BenchCycleOptions>();
  auto* restart = bench->add_subcommand("restart", "Engine restart on a version exported to disk: cold start to first token.");
  AddCommon(restart, r.get());
  restart->callback([r, exit_code] {
    Status s = Run(*r, false);
    if (!s.ok()) std::cerr << "bench restart: " << s.ToString() << "\n";
    *exit_code = s.ok() ? 0 : 1;
  });
}

}  // namespace rc::apps
