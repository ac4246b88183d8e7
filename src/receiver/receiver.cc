#include "rolloutcore/receiver/receiver.h"

#include "receiver/delta_apply.h"

#include <algorithm>
#include <optional>
#include <set>
#include <atomic>
#include <chrono>
#include <cstring>
#include <sstream>
#include <thread>

#include "refit/digest_simd.h"
#include "refit/landing_digest.h"
#include "rolloutcore/base/hash.h"
#include "rolloutcore/base/parallel.h"
#include "rolloutcore/base/mutex.h"
#include "rolloutcore/directory/client.h"
#include "rolloutcore/refit/digest.h"
#include "rolloutcore/refit/executor.h"
#include "rolloutcore/receiver/live_weights.h"
#include "rolloutcore/refit/layouts.h"
#include "receiver/nonfinite.h"
#include "receiver/pipeline.h"
#include "receiver/relay.h"

namespace rc::receiver {
namespace {

double MsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}


// The source tensor and global element index that copy `c` wrote to element `dest` of its
// parameter; false when the copy does not write it.
bool SourceElementOf(const refit::CapturedCopy& c, int64_t dest, std::string* where) {
  const size_t n = c.box.ndim();
  if (n == 0) return false;
  const refit::Shape g = refit::RowMajorStrides(c.source_shape);
  refit::Shape ds(n, 0);
  for (size_t k = 0; k < c.view_to_source.size(); ++k) {
    if (c.view_to_source[k] >= 0) ds[static_cast<size_t>(c.view_to_source[k])] = c.dest_strides[k];
  }
  for (size_t s = 0; s < n; ++s) {
    if (c.box.extent[s] <= 0) return false;
  }
  std::vector<int64_t> idx(n, 0);  // offsets inside the box
  for (;;) {
    int64_t d = c.dest_offset, gi = 0;
    for (size_t s = 0; s < n; ++s) {
      d += idx[s] * ds[s];
      gi += (c.box.start[s] + idx[s]) * g[s];
    }
    if (d == dest) {
      std::string coords;
      for (size_t s = 0; s < n; ++s) coords += (s ? ", " : "") + std::to_string(c.box.start[s] + idx[s]);
      *where = "tensor " + c.source + " element " + std::to_string(gi) + " (index [" + coords + "])";
      return true;
    }
    size_t s = n;
    while (s > 0) {
      --s;
      if (++idx[s] < c.box.extent[s]) break;
      idx[s] = 0;
      if (s == 0) return false;
    }
  }
}

// InvalidArgument naming the first non-finite staged weight (rank, then parameter order) by its
// source tensor and global element index.
Status CheckFinite(const std::vector<refit::Capture>& captures, const std::vector<refit::DestinationBuffers>& buffers,
                   int threads) {
  struct Item {
    size_t rank;
    uint32_t param;
    bool bf16;
    std::span<const std::byte> bytes;
  };
  std::vector<Item> items;
  for (size_t r = 0; r < captures.size(); ++r) {
    for (uint32_t p = 0; p < captures[r].params.size(); ++p) {
      const refit::TensorSpec& spec = captures[r].params[p];
      // The engine's parameters are f32 or bf16 (parameters.h).
      if (spec.dtype != refit::DType::kF32 && spec.dtype != refit::DType::kBF16) continue;
      auto it = buffers[r].find(spec.name);
      if (it == buffers[r].end()) continue;
      items.push_back({r, p, spec.dtype == refit::DType::kBF16, it->second});
    }
  }
  std::vector<int64_t> first(items.size(), -1);
  ParallelFor(items.size(), threads, [&](size_t i) {
    const std::byte* b = items[i].bytes.data();
    const refit::DType dtype = items[i].bf16 ? refit::DType::kBF16 : refit::DType::kF32;
    const size_t es = items[i].bf16 ? 2 : 4;
    const size_t count = items[i].bytes.size() / es;
    for (size_t k = 0; k < count; ++k) {
      uint32_t u = 0;
      std::memcpy(&u, b + es * k, es);  // little-endian: the element's bits, zero-extended
      if (IsNonFiniteBits(dtype, u)) {
        first[i] = static_cast<int64_t>(k);
        return;
      }
    }
  });
  for (size_t i = 0; i < items.size(); ++i) {
    if (first[i] < 0) continue;
    const Item& it = items[i];
    uint32_t u;
    if (it.bf16) {
      uint16_t h;
      std::memcpy(&h, it.bytes.data() + 2 * first[i], 2);
      u = static_cast<uint32_t>(h) << 16;
    } else {
      std::memcpy(&u, it.bytes.data() + 4 * first[i], 4);
    }
    const char* kind = (u & 0x007fffffu) != 0 ? "NaN" : (u & 0x80000000u) ? "-Inf" : "+Inf";
    const refit::Capture& cap = captures[it.rank];
    std::string where;
    for (const refit::CapturedCopy& c : cap.copies) {
      if (c.param == it.param && SourceElementOf(c, first[i], &where)) break;
    }
    if (where.empty()) {
      where = "parameter " + cap.params[it.param].name + " of rank " + std::to_string(it.rank) + " element " +
              std::to_string(first[i]);
    }
    return InvalidArgument(where + " is " + kind + "; non-finite weights are refused (nothing was staged, nothing "
                           "live was touched)");
  }
  return OkStatus();
}

// True when any bf16 element of the n bytes at p is NaN or +-Inf (32 elements per AVX-512 compare
// where the CPU has it; refit/digest_simd.h).
bool AnyNonFiniteBf16Bytes(const std::byte* p, size_t n) {
  return refit::internal::AnyNonFiniteBf16(p, static_cast<int64_t>(n / 2));
}

// AnyNonFiniteBf16Bytes over `spans`, in 1 MiB chunks on the shared pool.
bool AnyNonFiniteBf16(const std::vector<std::span<const std::byte>>& spans, int threads) {
  constexpr size_t kChunk = size_t{1} << 20;
  std::vector<std::span<const std::byte>> chunks;
  for (const auto& sp : spans) {
    for (size_t at = 0; at < sp.size(); at += kChunk) chunks.push_back(sp.subspan(at, std::min(kChunk, sp.size() - at)));
  }
  std::atomic<bool> bad{false};
  ParallelFor(chunks.size(), threads, [&](size_t i) {
    if (AnyNonFiniteBf16Bytes(chunks[i].data(), chunks[i].size())) bad.store(true, std::memory_order_relaxed);
  });
  return bad.load();
}

// The staged digest and the finite check of bf16 staging in one pass: the digest regions are cut
// into pieces (as DigestInstalledParallel does) and each task digests its piece and then scans the
// destination bytes the piece spans while they are still in cache. Bytes no piece spans (replicas
// no region owns) and pieces whose span is not compact (a permuted view) are scanned afterwards.
// Scanning a superset of the staged bytes is sound: every staged byte is a weight.
Result<refit::TensorDigests> DigestAndCheckBf16(const std::vector<refit::Capture>& captures,
                                                const std::vector<std::vector<refit::DigestRegion>>& regions,
                                                const std::vector<refit::UncoveredBytes>& uncovered,
                                                const std::vector<refit::DestinationBuffers>& buffers, int threads,
                                                bool* nonfinite) {
  struct Task {
    size_t rank;
    refit::DigestRegion piece;
    std::span<const std::byte> scan;
  };
  std::vector<Task> tasks;
  std::set<std::pair<size_t, std::string>> scan_whole;
  std::vector<std::span<const std::byte>> rest;
  for (size_t r = 0; r < captures.size(); ++r) {
    int64_t total = 0;
    for (const refit::DigestRegion& reg : regions[r]) total += reg.box.numel();
    const int64_t piece_elems = std::max<int64_t>(1 << 16, total / (int64_t{std::max(1, threads)} * 8));
    for (refit::DigestRegion& piece : refit::SplitDigestRegions(regions[r], piece_elems)) {
      Task t{r, piece, {}};
      const refit::CapturedCopy& c = captures[r].copies.at(piece.copy);
      const refit::TensorSpec& param = captures[r].params.at(c.param);
      auto it = buffers[r].find(param.name);
      const size_t n = piece.box.ndim();
      if (it != buffers[r].end() && param.dtype == refit::DType::kBF16 && n == c.box.ndim() && piece.box.numel() > 0) {
        refit::Shape ds(n, 0);
        for (size_t k = 0; k < c.view_to_source.size() && k < c.dest_strides.size(); ++k) {
          if (c.view_to_source[k] >= 0 && static_cast<size_t>(c.view_to_source[k]) < n) {
            ds[static_cast<size_t>(c.view_to_source[k])] += c.dest_strides[k];
          }
        }
        int64_t lo = c.dest_offset, span = 0;
        bool ok = true;
        for (size_t d = 0; d < n; ++d) {
          if (ds[d] < 0) ok = false;
          lo += (piece.box.start[d] - c.box.start[d]) * ds[d];
          span += (piece.box.extent[d] - 1) * ds[d];
        }
        const auto bytes = it->second;
        if (ok && lo >= 0 && span + 1 <= 2 * piece.box.numel() &&
            static_cast<size_t>(lo + span + 1) * 2 <= bytes.size()) {
          t.scan = std::span<const std::byte>(bytes.data() + lo * 2, static_cast<size_t>(span + 1) * 2);
        } else {
          scan_whole.emplace(r, param.name);
        }
      } else if (it != buffers[r].end()) {
        scan_whole.emplace(r, param.name);
      }
      tasks.push_back(std::move(t));
    }
    for (const auto& [name, ranges] : uncovered[r]) {
      auto it = buffers[r].find(name);
      if (it == buffers[r].end()) continue;
      for (const refit::ByteRange& br : ranges) {
        if (br.begin <= br.end && br.end <= it->second.size()) {
          rest.push_back(std::span<const std::byte>(it->second.data() + br.begin, br.end - br.begin));
        }
      }
    }
  }
  for (const auto& [r, name] : scan_whole) {
    const auto& bytes = buffers[r].at(name);
    rest.push_back(std::span<const std::byte>(bytes.data(), bytes.size()));
  }
  std::vector<Result<refit::TensorDigests>> partial(tasks.size(), refit::TensorDigests{});
  std::vector<char> bad(tasks.size(), 0);
  ParallelFor(tasks.size(), threads, [&](size_t i) {
    const Task& t = tasks[i];
    partial[i] = refit::DigestInstalled(captures[t.rank], buffers[t.rank], std::span<const refit::DigestRegion>(&t.piece, 1));
    if (!t.scan.empty() && AnyNonFiniteBf16Bytes(t.scan.data(), t.scan.size())) bad[i] = 1;
  });
  refit::TensorDigests out;
  for (size_t i = 0; i < partial.size(); ++i) {
    if (!partial[i].ok()) return partial[i].status();
    refit::AddDigests(out, *partial[i]);
    if (bad[i]) *nonfinite = true;
  }
  if (!*nonfinite && AnyNonFiniteBf16(rest, threads)) *nonfinite = true;
  return out;
}

}  // namespace

struct RefitReceiver::Staged {
  std::string model;
  std::string version;
  refit::Manifest manifest;
  refit::TensorDigests published;
  // The digest of the staged bytes, computed when they landed; the shadow buffers have been
  // read-only since, so it is the digest of what a swap install makes live.
  refit::TensorDigests staged_digest;
  StageReport report;
  // The image id of a pre-replay whose results the engine cached for this staged image (0: none).
  uint64_t prereplay_image = 0;
};

namespace {

int DefaultThreads(int threads) {
  if (threads > 0) return threads;
  return static_cast<int>(std::clamp(std::thread::hardware_concurrency(), 1u, 16u));
}

// The committed holder records of (model, version); a record that cannot be read is skipped.
std::vector<RelayRecord> FindRelayRecords(directory::DirectoryStore& dir, const std::string& model,
                                          const std::string& version) {
  std::vector<RelayRecord> out;
  auto list = dir.List(RelayModelName(model), directory::StateFilter::kCommitted);
  if (!list.ok()) return out;
  for (const directory::VersionInfo& info : *list) {
    std::string holder = RelayHolderOf(info.version, version);
    if (holder.empty()) continue;
    auto m = dir.Get(RelayModelName(model), info.version);
    if (!m.ok()) continue;
    out.push_back(RelayRecord{std::move(holder), std::move(m).value()});
  }
  return out;
}

// Holders of `sources` whose memory cannot be imported from here (shm: the owner process is gone).
std::vector<std::string> UnreachableHolders(const MergedSources& sources, transport::Transport& transport) {
  std::vector<std::string> dead;
  for (size_t h = 0; h < sources.holders.size(); ++h) {
    const int32_t rank = sources.first_relay_rank + static_cast<int32_t>(h);
    const refit::ShardInfo* probe = nullptr;
    for (const refit::ShardTable& t : sources.manifest.tables) {
      for (const refit::ShardInfo& s : t.shards) {
        if (s.rank == rank) {
          probe = &s;
          break;
        }
      }
      if (probe != nullptr) break;
    }
    if (probe == nullptr) continue;
    auto remote = transport.Import(probe->handle);
    if (!remote.ok()) {
      dead.push_back(sources.holders[h]);
    } else {
      (void)transport.ReleaseRemote(*remote);
    }
  }
  return dead;
}

// Which holder served how many of the planned bytes.
FanOutReport SourcesReport(const std::vector<refit::TransferPlan>& plans, const MergedSources& sources,
                           size_t records, const std::set<std::string>& failed, int failovers) {
  FanOutReport out;
  out.holder_records = records;
  out.failed_holders.assign(failed.begin(), failed.end());
  out.failovers = failovers;
  for (const refit::TransferPlan& p : plans) {
    for (const refit::ReadRun& run : p.runs) {
      const int32_t rank = p.sources[run.source].rank;
      const int64_t h = static_cast<int64_t>(rank) - sources.first_relay_rank;
      if (h >= 0 && h < static_cast<int64_t>(sources.holders.size())) {
        out.relay_bytes += run.length;
        out.by_holder[sources.holders[static_cast<size_t>(h)]] += run.length;
      } else {
        out.origin_bytes += run.length;
      }
    }
  }
  return out;
}

}  // namespace

RefitReceiver::RefitReceiver(LiveWeights* live, int threads)
    : live_(live),
      config_(live->RefitModelConfig()),
      threads_(DefaultThreads(threads)),
      plans_(std::make_unique<internal::RankPlans>()) {}
RefitReceiver::~RefitReceiver() {
  rc::MutexLock lock(mu_);
  if (retiring_.joinable()) retiring_.join();
}

std::string RefitReceiver::staged_version() const {
  rc::MutexLock lock(mu_);
  return staged_ ? staged_->version : "";
}

namespace {

// The swap-heads fault (SetSwapQHeadsForTesting): splits every copy of layer 0's q_proj weight
// so that its first two head_dim-row slabs land in each other's destination rows.
Status SwapFirstTwoQHeads(refit::Capture* capture, int64_t head_dim) {
  const std::string source = "model.layers.0.self_attn.q_proj.weight";
  std::vector<refit::CapturedCopy> out;
  bool swapped = false;
  for (const refit::CapturedCopy& c : capture->copies) {
    const bool plain_rows = c.source == source && c.view_to_source == std::vector<int32_t>{0, 1} &&
                            c.box.extent.size() == 2 && c.box.extent[0] >= 2 * head_dim && c.dest_strides.size() == 2;
    if (!plain_rows) {
      out.push_back(c);
      continue;
    }
    auto piece = [&](int64_t first_row, int64_t rows, int64_t dest_row) {
      refit::CapturedCopy p = c;
      p.box.start[0] += first_row;
      p.box.extent[0] = rows;
      p.dest_shape[0] = rows;
      p.dest_offset = c.dest_offset + dest_row * c.dest_strides[0];
      out.push_back(std::move(p));
    };
    piece(0, head_dim, head_dim);  // head 0's rows into head 1's place
    piece(head_dim, head_dim, 0);  // and head 1's into head 0's
    if (c.box.extent[0] > 2 * head_dim) piece(2 * head_dim, c.box.extent[0] - 2 * head_dim, 2 * head_dim);
    swapped = true;
  }
  if (!swapped) return FailedPrecondition("swap_q_heads fault: no copy of " + source + " with two heads to swap");
  capture->copies = std::move(out);
  return OkStatus();
}

}  // namespace

void RefitReceiver::SetSwapQHeadsForTesting(bool on) {
  rc::MutexLock l(mu_);
  if (swap_q_heads_ == on) return;
  swap_q_heads_ = on;
  delta_chain_.reset();  // its delta was planned on the captures dropped here
  captures_.clear();
  digest_regions_.clear();
  plans_->Reset();
}

Status RefitReceiver::EnsureCaptures() {
  if (!captures_.empty()) return OkStatus();
  refit::EngineLayout layout;
  layout.tp = live_->tensor_parallel_size();
  // Staging and planning in the live parameters' dtype: a source of that dtype lands as bytes.
  RC_ASSIGN_OR_RETURN(layout.param_dtype, live_->RefitWeightDType());
  for (int r = 0; r < layout.tp; ++r) {
    RC_ASSIGN_OR_RETURN(refit::Capture c, refit::CaptureEngineRank(config_, layout, r));
    if (swap_q_heads_) {
      Status s = SwapFirstTwoQHeads(&c, config_.head_dim);
      if (!s.ok()) {
        captures_.clear();
        return s;
      }
    }
    captures_.push_back(std::move(c));
  }
  std::vector<const refit::Capture*> ptrs;
  for (const auto& c : captures_) ptrs.push_back(&c);
  digest_regions_ = refit::AssignDigestOwnership(ptrs);
  uncovered_.clear();
  for (size_t r = 0; r < captures_.size(); ++r) {
    RC_ASSIGN_OR_RETURN(refit::UncoveredBytes u, refit::BytesOutsideRegions(captures_[r], digest_regions_[r]));
    uncovered_.push_back(std::move(u));
  }
  return OkStatus();
}

std::vector<refit::DestinationBuffers> RefitReceiver::LiveBuffers() {
  std::vector<refit::DestinationBuffers> out;
  for (int r = 0; r < live_->tensor_parallel_size(); ++r) {
    refit::DestinationBuffers b;
    for (const auto& [name, p] : live_->Parameters(r).all()) {
      b.emplace(name, std::span<std::byte>(p.bytes(), p.nbytes()));
    }
    out.push_back(std::move(b));
  }
  return out;
}

Result<refit::TensorDigests> RefitReceiver::DigestOf(const std::vector<refit::DestinationBuffers>& buffers,
                                                     bool* any_nonfinite_f32) {
  refit::TensorDigests total;
  for (size_t r = 0; r < captures_.size(); ++r) {
    RC_ASSIGN_OR_RETURN(refit::TensorDigests d, refit::DigestInstalledParallel(captures_[r], buffers[r],
                                                                               digest_regions_[r], threads_,
                                                                               any_nonfinite_f32));
    refit::AddDigests(total, d);
  }
  return total;
}

Result<StageReport> RefitReceiver::Stage(const StageRequest& req) {
  if (req.model.empty() || req.version.empty() || req.directory.empty()) {
    return InvalidArgument("stage needs model, version and directory");
  }
  if (req.timeout_ms <= 0 || req.timeout_ms > kMaxStageTimeoutMs) {
    return InvalidArgument("timeout_ms: must be in [1, " + std::to_string(kMaxStageTimeoutMs) + "], got " +
                           std::to_string(req.timeout_ms));
  }
  const auto t_call = std::chrono::steady_clock::now();
  const auto deadline = t_call + std::chrono::milliseconds(req.timeout_ms);
  bool got_gate = false;
  {
    rc::MutexLock g(gate_mu_);
    got_gate = gate_cv_.wait_until(g, deadline, [&]() REQUIRES(gate_mu_) { return !stage_busy_; });
    if (got_gate) stage_busy_ = true;
  }
  struct ReleaseGate {
    RefitReceiver* r;
    bool held;
    ~ReleaseGate() {
      if (!held) return;
      {
        rc::MutexLock g(r->gate_mu_);
        r->stage_busy_ = false;
      }
      r->gate_cv_.notify_one();
    }
  } release_gate{this, got_gate};
  if (!got_gate) {
    rc::MutexLock metrics_lock(metrics_mu_);
    ++stages_failed_;
    return Unavailable("stage of " + req.version + " could not start within its timeout_ms " +
                       std::to_string(req.timeout_ms) + ": the stage of " + stage_running_ + " has been running for " +
                       std::to_string(static_cast<int64_t>(MsSince(stage_started_))) + " ms; retry");
  }
  {
    rc::MutexLock metrics_lock(metrics_mu_);
    stage_running_ = req.version;
    stage_started_ = std::chrono::steady_clock::now();
  }
  struct ClearRunning {
    RefitReceiver* r;
    ~ClearRunning() {
      rc::MutexLock metrics_lock(r->metrics_mu_);
      r->stage_running_.clear();
    }
  } clear_running{this};
  rc::MutexLock lock(mu_);
  // What is staged stays staged until this stage has found its version in the directory
  // (StageLocked): a refusal before then (unknown version, directory
  // unreachable or not on this host) leaves it installable.
  StageRequest left = req;  // what is left of the deadline after waiting for the gate and mu_
  left.timeout_ms = std::max<int64_t>(
      1, std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count());
  auto result = StageLocked(left);
  if (result.ok() && staged_) {
    staged_->report.prereplay = PreReplayLocked(deadline);
    // The whole call on the engine's side (gate, stage, pre-replay): a caller's wall time beyond
    // it is dispatch (bench cycle's accounting).
    staged_->report.call_ms = MsSince(t_call);
    result = staged_->report;
  }
  rc::MutexLock metrics_lock(metrics_mu_);
  if (result.ok()) {
    ++stages_ok_;
  } else {
    ++stages_failed_;
  }
  return result;
}

// One full stage's state, threaded through the named steps of the staging pipeline (StageLocked):
// resolve in the directory → plan → the import cache keyed by topology → pull (relay failover) →
// verify on landing → seal and keep. The delta path branches off after the resolve
// (TryStageDelta, receiver_delta.cc).
struct RefitReceiver::FullStage {
  explicit FullStage(const StageRequest& r)
      : req(r),
        deadline(std::chrono::steady_clock::now() + std::chrono::milliseconds(r.timeout_ms)),
        t_total(std::chrono::steady_clock::now()) {}
  const StageRequest& req;
  const std::chrono::steady_clock::time_point deadline;
  const std::chrono::steady_clock::time_point t_total;
  StepTimings stages;
  // Discovery (pipeline.h): the directory client, the manifest and its published digests.
  internal::ResolvedVersion resolved;
  std::optional<directory::DirectoryClient>& dir = resolved.dir;
  refit::Manifest& manifest = resolved.manifest;
  refit::TensorDigests& published = resolved.published;
  std::string why_full;
  std::optional<DeltaChoice> choice;  // set when the policy chose full over an applicable-looking delta
  // Fan-out (relay.h): the holder records found, the holders excluded, what is planned against.
  std::vector<RelayRecord> relay_records;
  std::set<std::string> failed_holders;
  MergedSources sources;
  int failovers = 0;
  // Planning and registration.
  uint64_t topo = 0;
  bool plan_cached = false, shadow_allocated = false, transport_cached = false;
  double registration_ms = 0, protect_ms = 0;
  std::string transport_name;
  // The pull.
  uint64_t bytes = 0, reads = 0;
  int64_t import_ns = 0, wire_ns = 0, transform_ns = 0;
  double wire_ms = 0;
  // Verified on landing.
  refit::TensorDigests got;
  size_t digested_on_landing = 0, scanned_on_landing = 0;
};

Result<StageReport> RefitReceiver::StageLocked(const StageRequest& req) {
  FullStage s(req);
  RC_RETURN_IF_ERROR(ResolveInDirectory(&s));

  auto t = std::chrono::steady_clock::now();
  RC_RETURN_IF_ERROR(EnsureCaptures());
  s.stages["source_preparation"] = MsSince(t);
  {
    // Every published tensor must be one this engine loads: a version with a tensor the model does
    // not have (another architecture, more layers, a stray name) is refused now, naming it, not
    // after every byte has moved (where it would read as a digest mismatch).
    std::set<std::string, std::less<>> used;
    for (const refit::Capture& c : captures_) {
      for (const refit::CapturedCopy& copy : c.copies) used.insert(copy.source);
    }
    for (const refit::ShardTable& table : s.manifest.tables) {
      if (used.count(table.name)) continue;
      std::string why = "this engine's model has no parameter loaded from it";
      if (table.name == "lm_head.weight" && used.count("model.embed_tokens.weight")) {
        why = "this engine ties lm_head to model.embed_tokens.weight (tie_word_embeddings); publish without "
              "lm_head.weight (named_parameters() leaves it out)";
      }
      return InvalidArgument("version " + req.version + " of " + req.model + " publishes tensor " + table.name +
                             ", which does not fit this engine: " + why);
    }
  }
  // Found and fits: from here on the stage replaces what was staged (the shadow buffers are about
  // to be overwritten, and a pre-replay of what they held must never be served again).
  staged_.reset();
  delta_staged_.reset();
  live_->DropPreReplay();

  // Delta refit (receiver_delta.cc): on a proven base only the changes move; otherwise in full.
  // A version that carries deltas also carries its full shards: the policy (refit_choice.h) says
  // which of the two to stage, by this receiver's own measured costs under auto.
  std::optional<DeltaChoice> choice;
  if (internal::CarriesDelta(s.manifest)) {
    RC_ASSIGN_OR_RETURN(const std::string transport, refit::ManifestTransport(s.manifest));
    choice = stage_costs_.Choose(delta_policy_, transport, WorkOf(s.manifest));
  }
  if (choice && !choice->delta) {
    s.why_full = choice->reason;
    s.choice = std::move(choice);
  } else if (auto delta = TryStageDelta(req, s.manifest, s.published, s.stages, &s.why_full)) {
    if (!delta->ok()) return delta->status();
    StageReport report = std::move(*delta).value();
    report.delta_choice = std::move(choice);
    return KeepStaged(&s, std::move(report), {});
  }
  delta_chain_.reset();  // a full stage overwrites the staging image

  RC_RETURN_IF_ERROR(FindRelaySources(&s));
  for (;;) {
    RC_RETURN_IF_ERROR(PlanRanks(&s));
    // Registration: shadow parameters (never the live ones; allocated once and kept), the
    // transport, and (inside the executor, reported separately) descriptor import.
    t = std::chrono::steady_clock::now();
    RC_RETURN_IF_ERROR(EnsureShadow(&s));
    if (!arena_) arena_ = std::make_unique<refit::StagingArena>();
    // Replaced shm sources, released after the pull (SealStaged), off the stage's path.
    SourceImports retired;
    RC_RETURN_IF_ERROR(EnsureSourceImports(&s, &retired));
    // A failed pull may have left an import that no longer maps what the trainer serves (a
    // restarted trainer reusing a segment name): drop the cache so the next stage imports afresh.
    struct DropOnFailure {
      RefitReceiver* r;
      bool armed = true;
      ~DropOnFailure() {
        if (armed) r->sources_.Reset();
      }
    } drop_on_failure{this};
    s.registration_ms += MsSince(t);

    // The shadow buffers were made read-only when their last stage was digested (or are the live
    // storage a swap install retired, read-only too): writable again before anything lands.
    auto t_protect = std::chrono::steady_clock::now();
    RC_RETURN_IF_ERROR(SetShadowReadOnly(false));
    s.protect_ms = MsSince(t_protect);
    // Where the transport lands bytes with the CPU (shm), the staged digest and the finite check
    // ride along with the landing copy, read back from the staged bytes while they are in cache
    // (refit/landing_digest.h); whatever it did not cover whole is digested after the wire.
    refit::LandingDigest landing(captures_, digest_regions_, uncovered_, shadow_buffers_, plans_->plans());
    RC_ASSIGN_OR_RETURN(const bool failed_over, PullRanks(&s, &landing));
    if (failed_over) continue;  // planned again against the remaining holders
    RC_RETURN_IF_ERROR(VerifyOnLanding(&s, &landing));
    drop_on_failure.armed = false;  // the pull and its digest succeeded: keep the imports
    return SealStaged(&s, std::move(retired));
  }
}

Status RefitReceiver::ResolveInDirectory(FullStage* s) {
  auto t = std::chrono::steady_clock::now();
  RC_RETURN_IF_ERROR(
      internal::ResolveInDirectory(s->req.directory, s->req.model, s->req.version, s->deadline, &s->resolved));
  s->stages["discovery"] = MsSince(t);
  return OkStatus();
}

Status RefitReceiver::FindRelaySources(FullStage* s) {
  // Fan-out (relay.h): the holder records of this version, merged into what we plan against.
  if (s->req.use_relays) s->relay_records = FindRelayRecords(*s->dir, s->req.model, s->req.version);
  if (!s->relay_records.empty()) {
    RC_ASSIGN_OR_RETURN(s->sources, MergeRelayHolders(s->manifest, s->relay_records, s->failed_holders));
  } else {
    s->sources.manifest = s->manifest;
  }
  return OkStatus();
}

Status RefitReceiver::PlanRanks(FullStage* s) {
  // Plans are rebuilt only when the source topology (or the receiver rank) changes.
  auto t = std::chrono::steady_clock::now();
  s->topo = internal::StageTopology(s->sources.manifest, s->req.receiver_rank);
  RC_ASSIGN_OR_RETURN(s->plan_cached, plans_->Ensure(captures_, s->sources.manifest, s->topo, s->req.receiver_rank));
  s->stages["planning"] = MsSince(t);
  return OkStatus();
}

Status RefitReceiver::EnsureShadow(FullStage* s) {
  if (shadow_.size() == captures_.size()) return OkStatus();
  shadow_.assign(captures_.size(), {});
  shadow_buffers_.clear();
  for (size_t r = 0; r < captures_.size(); ++r) {
    refit::DestinationBuffers b;
    for (const auto& spec : captures_[r].params) {
      // In the live parameter's dtype and layout (the capture's), so an install can exchange it.
      RC_ASSIGN_OR_RETURN(auto buf, WeightBuffer::Allocate(static_cast<size_t>(spec.bytes())));
      b.emplace(spec.name, std::span<std::byte>(buf->data(), buf->size()));
      shadow_[r][spec.name] = std::move(buf);
    }
    shadow_buffers_.push_back(std::move(b));
  }
  s->shadow_allocated = true;
  return OkStatus();
}

Status RefitReceiver::EnsureSourceImports(FullStage* s, SourceImports* retired) {
  RC_ASSIGN_OR_RETURN(s->transport_name, refit::ManifestTransport(s->sources.manifest));
  s->transport_cached = sources_.Holds(s->transport_name, s->topo);
  if (s->transport_cached) return OkStatus();
  // A new source topology (a new version's buffers) replaces the shm transport and its imports.
  // Unmapping the old sources is no part of this pull: they are kept until the pull is done, then
  // released on a thread of their own (while the pre-replay computes). Released during the pull,
  // the unmapping would hold the address space's lock the new imports and the protect need.
  if (retiring_.joinable()) retiring_.join();
  if (sources_.ready() && sources_.transport_name() == "shm") *retired = std::move(sources_);
  RC_RETURN_IF_ERROR(sources_.Create(s->transport_name, s->topo));
  ++transports_built_;
  return OkStatus();
}

Result<bool> RefitReceiver::PullRanks(FullStage* s, refit::LandingDigest* landing) {
  transport::Transport& transport = sources_.transport();
  for (size_t r = 0; r < captures_.size(); ++r) {
    refit::ExecuteOptions eo;
    eo.landing_observer = landing;
    eo.arena = arena_.get();
    eo.transform_threads = threads_;
    eo.imports = &sources_.imports();
    eo.timeout_ms = internal::MsLeft(s->deadline);
    auto st = refit::ExecutePlan(plans_->plans()[r], transport, shadow_buffers_[r], eo);
    if (!st.ok()) {
      // A relay whose memory cannot be reached any more is excluded (and its record marked
      // unavailable: we proved its owner gone); the pull restarts from the remaining holders.
      std::vector<std::string> dead = UnreachableHolders(s->sources, transport);
      if (!dead.empty() && std::chrono::steady_clock::now() < s->deadline) {
        for (const std::string& holder : dead) {
          s->failed_holders.insert(holder);
          (void)s->dir->MarkUnavailable(RelayModelName(s->req.model), RelayLabel(s->req.version, holder),
                                        "relay holder " + holder + " unreachable from a receiver of " +
                                            s->req.version + ": " + std::string(st.status().message().substr(0, 200)));
        }
        ++s->failovers;
        RC_ASSIGN_OR_RETURN(s->sources, MergeRelayHolders(s->manifest, s->relay_records, s->failed_holders));
        s->bytes = s->reads = 0;
        return true;
      }
      return st.status().WithContext("pulling " + s->req.version + " into rank " + std::to_string(r));
    }
    s->bytes += st->bytes_read;
    s->reads += st->reads;
    s->import_ns += st->import_ns + st->staging_ns;
    s->wire_ns += st->wire_ns;
    s->transform_ns += st->transform_ns;
  }
  s->stages["registration"] = s->registration_ms + static_cast<double>(s->import_ns) / 1e6;
  s->wire_ms = static_cast<double>(s->wire_ns) / 1e6;
  s->stages["wire"] = s->wire_ms;
  s->stages["transform"] = static_cast<double>(s->transform_ns) / 1e6;
  return false;
}

Status RefitReceiver::VerifyOnLanding(FullStage* s, refit::LandingDigest* landing) {
  // The staged digest pass also checks that every f32 weight it reads is finite. It covers only
  // the parameters the landing digest did not take whole.
  auto t = std::chrono::steady_clock::now();
  refit::LandingDigest::Outcome landed = landing->Finish();
  bool nonfinite = landed.nonfinite;
  std::vector<std::vector<refit::DigestRegion>> rest_regions(captures_.size());
  std::vector<refit::UncoveredBytes> rest_uncovered(captures_.size());
  for (size_t r = 0; r < captures_.size(); ++r) {
    for (const refit::DigestRegion& reg : digest_regions_[r]) {
      const std::string& param = captures_[r].params.at(captures_[r].copies.at(reg.copy).param).name;
      if (landed.fallback.contains({r, param})) rest_regions[r].push_back(reg);
    }
    for (const auto& [param, ranges] : uncovered_[r]) {
      if (landed.fallback.contains({r, param})) rest_uncovered[r].emplace(param, ranges);
    }
  }
  const Result<refit::DType> live_dtype = live_->RefitWeightDType();
  const bool bf16 = live_dtype.ok() && *live_dtype == refit::DType::kBF16;
  s->got = std::move(landed.digests);
  if (bf16) {
    // bf16 staging: digest and finite check in one pass per piece (DigestAndCheckBf16).
    RC_ASSIGN_OR_RETURN(refit::TensorDigests rest, DigestAndCheckBf16(captures_, rest_regions, rest_uncovered,
                                                                      shadow_buffers_, threads_, &nonfinite));
    refit::AddDigests(s->got, rest);
  } else {
    for (size_t r = 0; r < captures_.size(); ++r) {
      RC_ASSIGN_OR_RETURN(refit::TensorDigests rest,
                          refit::DigestInstalledParallel(captures_[r], shadow_buffers_[r], rest_regions[r], threads_,
                                                         &nonfinite));
      refit::AddDigests(s->got, rest);
    }
  }
  size_t params_total = 0;
  for (const refit::Capture& c : captures_) params_total += c.params.size();
  s->scanned_on_landing = landed.scanned_only;
  s->digested_on_landing = params_total - landed.fallback.size() - s->scanned_on_landing;
  s->stages["receive_sync"] = MsSince(t);

  // A NaN or Inf the trainer published has a valid digest; refuse it here, before anything can
  // be installed. Bytes no digest region owns (replicas) are scanned on their own; only when
  // something is non-finite does the full check run, to name the element.
  t = std::chrono::steady_clock::now();
  // (bf16 staging: every byte, replicas included, was scanned in the digest pass above; replicas
  // scanned while they landed are not in rest_uncovered.)
  if (!nonfinite && !bf16) nonfinite = AnyNonFiniteUncoveredF32(rest_uncovered);
  if (nonfinite) {
    RC_RETURN_IF_ERROR(
        CheckFinite(captures_, shadow_buffers_, threads_).WithContext("staged weights of " + s->req.version));
  }
  s->stages["finite_check"] = MsSince(t);
  return internal::CheckStagedDigests(s->got, s->published, s->req.model, s->req.version, /*subset=*/false);
}

bool RefitReceiver::AnyNonFiniteUncoveredF32(const std::vector<refit::UncoveredBytes>& uncovered) {
  for (size_t r = 0; r < captures_.size(); ++r) {
    for (const auto& [name, ranges] : uncovered[r]) {
      auto it = shadow_buffers_[r].find(name);
      if (it == shadow_buffers_[r].end()) continue;
      for (const refit::ByteRange& br : ranges) {
        if (br.end <= it->second.size() &&
            refit::internal::AnyNonFiniteF32(it->second.data() + br.begin, static_cast<int64_t>((br.end - br.begin) / 4))) {
          return true;
        }
      }
    }
  }
  return false;
}

Result<StageReport> RefitReceiver::SealStaged(FullStage* s, SourceImports retired) {
  // From here until they are swapped in (or re-used by the next stage) the staged bytes cannot
  // change: the digest just computed stays the digest of these bytes.
  auto t_protect = std::chrono::steady_clock::now();
  RC_RETURN_IF_ERROR(SetShadowReadOnly(true));
  s->protect_ms += MsSince(t_protect);
  s->stages["protect"] = s->protect_ms;  // mprotect of the shadow: writable before the pull, read-only after
  // The replaced sources are unmapped on a thread of their own from here, while the pre-replay
  // computes. Not earlier: the unmapping holds the address space's lock for ~60 ms (1.2 GB of
  // small pages for qwen3-0.6b), and the protect above waited for it all when it started right
  // after the pull (session 13; in 64 MiB pieces too: the unmapping thread takes the lock back
  // first). Not later: past the stage call it ran into the pause window (3 -> 23-32 ms).
  if (retired.ready()) {
    retiring_ = std::thread([old = std::move(retired)]() mutable { old.Reset(); });
  }
  s->stages["total"] = MsSince(s->t_total);
  const double gbps = s->wire_ms > 0 ? static_cast<double>(s->bytes) / (s->wire_ms * 1e6) : 0.0;
  StageReport report = FullStageEvidence(*s, gbps);
  {
    rc::MutexLock metrics_lock(metrics_mu_);
    last_stage_ms_ = s->stages;
    last_wire_gbps_ = gbps;
    bytes_pulled_total_ += s->bytes;
  }
  return KeepStaged(s, std::move(report), std::move(s->got));
}

StageReport RefitReceiver::FullStageEvidence(const FullStage& s, double gbps) const {
  FullStageReport full;
  const refit::PlanStats total = plans_->TotalStats();
  full.bytes_planned = total.bytes_planned;
  full.bytes_needed = total.bytes_needed;
  full.descriptors = total.descriptors;
  full.full_pulls = total.full_pulls;
  full.reads = s.reads;
  full.plan_cached = s.plan_cached;
  full.plans_built = plans_->built();
  full.shadow_allocated = s.shadow_allocated;
  full.transport_cached = s.transport_cached;
  full.transports_built = transports_built_;
  full.params_digested_while_landing = s.digested_on_landing;
  full.params_scanned_while_landing = s.scanned_on_landing;
  full.wire_gbps = gbps;
  if (s.req.use_relays) {
    full.sources = SourcesReport(plans_->plans(), s.sources, s.relay_records.size(), s.failed_holders, s.failovers);
  }
  StageReport report;
  report.version = s.req.version;
  report.model = s.req.model;
  report.mode_reason = s.why_full;
  report.transport = s.transport_name;
  report.bytes_pulled = s.bytes;
  report.threads = threads_;
  report.digest_check = "staged bytes match the manifest, tensor by tensor";
  report.content_digest = ContentDigest(s.manifest.content_digest);
  report.stages_ms = s.stages;
  report.by_mode = std::move(full);
  report.delta_choice = s.choice;
  return report;
}

StageReport RefitReceiver::KeepStaged(FullStage* s, StageReport report, refit::TensorDigests staged_digest) {
  // What this stage cost, for the next choice between full and delta (refit_choice.h): the stage's
  // own work — a full stage's total less discovery; a delta stage's total starts after the base
  // proof already.
  const auto at = [&](const char* k) {
    const auto it = report.stages_ms.find(k);
    return it == report.stages_ms.end() ? 0.0 : it->second;
  };
  if (const FullStageReport* full = report.full()) {
    // A stage that allocated the staging image paid once for what every later one reuses (the
    // allocation and its first-touch page faults): it says nothing about the next full stage.
    if (!full->shadow_allocated) {
      stage_costs_.RecordFull(report.transport, WorkOf(s->manifest), at("total") - at("discovery"));
    }
  } else {
    stage_costs_.RecordDelta(report.transport, WorkOf(s->manifest), at("total"));
  }
  auto staged = std::make_unique<Staged>();
  staged->model = s->req.model;
  staged->version = s->req.version;
  staged->staged_digest = std::move(staged_digest);
  staged->published = std::move(s->published);
  staged->manifest = std::move(s->manifest);
  staged->report = std::move(report);
  staged_ = std::move(staged);
  return staged_->report;
}

Result<RelayReport> RefitReceiver::Relay(const RelayRequest& req) {
  if (req.model.empty() || req.version.empty() || req.directory.empty() || req.holder.empty()) {
    return InvalidArgument("relay needs model, version, directory and holder");
  }
  RC_RETURN_IF_ERROR(directory::ValidateName(req.holder, "relay holder"));
  rc::MutexLock lock(mu_);
  const refit::Manifest* manifest = nullptr;
  std::vector<refit::DestinationBuffers> buffers;
  RelayFrom from = RelayFrom::kStaged;
  if (staged_ && staged_->model == req.model && staged_->version == req.version) {
    manifest = &staged_->manifest;
    buffers = shadow_buffers_;
  } else if (installed_manifest_ && installed_model_ == req.model && installed_manifest_->version == req.version &&
             live_->WeightVersion() == req.version) {
    manifest = &*installed_manifest_;
    buffers = LiveBuffers();
    from = RelayFrom::kInstalled;
  } else {
    return FailedPrecondition("relay of " + req.version + " of " + req.model +
                              " refused: that version is neither staged nor live on this engine");
  }
  RC_ASSIGN_OR_RETURN(std::string transport_name, refit::ManifestTransport(*manifest));
  if (transport_name != "shm" && transport_name != "ucx") {
    return FailedPrecondition("relay of " + req.version + " refused: its sources use " + transport_name +
                              "; relays serve host memory over shm or ucx, and one version uses one transport");
  }
  auto t = std::chrono::steady_clock::now();
  RC_ASSIGN_OR_RETURN(std::unique_ptr<RelayHolding> holding,
                      BuildRelayHolding(*manifest, captures_, buffers, req.model, req.holder));
  const double build_ms = MsSince(t);
  directory::DirectoryClient dir(req.directory);
  directory::PublishRequest pub;
  pub.model = RelayModelName(req.model);
  pub.version = RelayLabel(req.version, req.holder);
  pub.rank = 0;
  pub.expected_ranks = 1;
  pub.lease_ttl_ms = req.lease_ttl_ms;
  pub.tables = holding->tables;
  RC_ASSIGN_OR_RETURN(directory::PublishResult published, dir.Publish(pub));
  if (published.state != directory::VersionState::kCommitted) {
    return Internal("relay record " + pub.version + " of " + pub.model + " did not commit");
  }
  if (relay_ && !(relay_->model == req.model && relay_->version == req.version)) {
    // The old record names memory we are about to free.
    directory::DirectoryClient old_dir(relay_directory_);
    (void)old_dir.MarkUnavailable(RelayModelName(relay_->model), RelayLabel(relay_->version, relay_->holder),
                                  "relay holder " + relay_->holder + " now relays " + req.version);
  }
  RelayReport out;
  out.holder = req.holder;
  out.relay_model = pub.model;
  out.relay_version = pub.version;
  out.from = from;
  out.bytes = holding->bytes;
  out.registrations = holding->registrations.size();
  out.content_digest = ContentDigest(published.content_digest);
  out.build_ms = build_ms;
  relay_ = std::move(holding);
  relay_directory_ = req.directory;
  return out;
}

std::string_view InstallOutcomeName(InstallOutcome o) {
  switch (o) {
    case InstallOutcome::kRefusedUntouched: return "refused_untouched";
    case InstallOutcome::kInstalled: return "installed";
    case InstallOutcome::kFailedAfterMutation: return "failed_after_mutation";
  }
  return "unknown";
}

InstallResult RefitReceiver::Install(const std::string& version, bool skip_cache_reset) {
  const auto t_call = std::chrono::steady_clock::now();
  rc::MutexLock lock(mu_);
  std::atomic<bool> touched{false};
  auto result = InstallLocked(version, skip_cache_reset, &touched);
  InstallResult out;
  if (result.ok()) {
    out.outcome = InstallOutcome::kInstalled;
    out.report = std::move(result).value();
    // The whole call on the engine's side (lock, install, protect, live digest, pre-replay
    // adoption), as for the stage.
    out.report.call_ms = MsSince(t_call);
  } else {
    // The fact comes from the copy itself, not from the error's code.
    out.outcome = touched.load() ? InstallOutcome::kFailedAfterMutation : InstallOutcome::kRefusedUntouched;
    out.status = result.status();
    if (out.outcome == InstallOutcome::kFailedAfterMutation) mutated_unproven_ = true;
  }
  rc::MutexLock metrics_lock(metrics_mu_);
  switch (out.outcome) {
    case InstallOutcome::kInstalled:
      ++installs_ok_;
      last_install_ms_ = out.report.stages_ms;
      bytes_installed_total_ += out.report.bytes_installed;
      break;
    case InstallOutcome::kRefusedUntouched: ++installs_refused_; break;
    case InstallOutcome::kFailedAfterMutation: ++installs_failed_; break;
  }
  return out;
}

Result<InstallReport> RefitReceiver::InstallLocked(const std::string& version, bool skip_cache_reset,
                                                   std::atomic<bool>* touched) {
  if (!live_->IsPaused()) {
    return FailedPrecondition("install refused: the engine is not paused (pause it first); nothing was touched");
  }
  if (!staged_) {
    return FailedPrecondition("install refused: nothing is staged (stage " + version + " first)");
  }
  if (staged_->version != version) {
    return FailedPrecondition("install refused: staged version is " + staged_->version + ", not " + version);
  }
  const uint64_t prereplay_image = staged_->prereplay_image;
  // After an install that swapped the pre-replayed image in and proved it: the engine may serve
  // the pre-replay's results at exactly the install generation this install produced.
  auto adopt = [this, prereplay_image](InstallReport* report) {
    if (prereplay_image == 0) return;
    report->prereplay_adopted = live_->AdoptPreReplay(prereplay_image, live_->InstallGeneration());
  };
  if (delta_staged_) {
    const bool swap = delta_staged_->to_staging;
    auto delta = InstallDeltaLocked(version, skip_cache_reset, touched, staged_->report, staged_->published,
                                    staged_->manifest);
    if (delta.ok()) {
      staged_.reset();
      if (swap) adopt(&*delta);
    }
    return delta;
  }
  StepTimings stages = staged_->report.stages_ms;
  auto t = std::chrono::steady_clock::now();
  std::atomic<uint64_t> bytes{0};
  // Install by swap (docs/refit.md): the staged image covers every live parameter in its dtype
  // and size, so the staged storage becomes the live storage and no live byte is copied.
  if (SwapCoversLive()) {
    auto exchange = [this, &bytes, touched](int rank, ParameterStore* params) REQUIRES(mu_)
        -> Status {
      const size_t r = static_cast<size_t>(rank);
      auto& shadow = shadow_[r];
      uint64_t rank_bytes = 0;
      // The exchange below is the mutation point: the live storage changes there.
      touched->store(true);
      for (const auto& [name, p] : params->all()) {
        if (!p.alias_of.empty()) continue;  // follows its target (tied lm_head)
        const size_t n = p.nbytes();
        RC_RETURN_IF_ERROR(params->ExchangeStorage(name, &shadow.at(name)));
        rank_bytes += n;
      }
      // The retired live storage is the next stage's staging (read-only until that stage).
      for (auto& [name, buf] : shadow) shadow_buffers_[r][name] = std::span<std::byte>(buf->data(), buf->size());
      bytes += rank_bytes;
      if (rank == 0 && fail_after_first_rank_.load()) {
        return FailedPrecondition("injected fault: install failed after rank 0 swapped in its weights");
      }
      return OkStatus();
    };
    live_cache_valid_ = false;  // the live weights are about to change
    Status st = live_->InstallLive(exchange, version, ++generation_, !skip_cache_reset,
                                    InstallWrites::kExchange);
    if (!st.ok()) return st.WithContext("install of " + version);
    stages["install"] = MsSince(t);
    t = std::chrono::steady_clock::now();
    // The live weights are exactly the bytes the staged digest read (read-only since).
    refit::TensorDigests live = staged_->staged_digest;
    stages["post_install"] = MsSince(t);
    auto out = FinishFullInstall(version, skip_cache_reset, live, bytes.load(), std::move(stages), InstallMode::kSwap);
    if (out.ok()) adopt(&*out);
    return out;
  }
  // The live digest rides along with the copy: each rank's install copies its staged bytes into
  // the live parameters and digests the values it stores (refit::CopyAndDigestInstalledParallel),
  // so no second pass reads the 1.5 GB back. LiveDigest(fresh) still reads the live memory.
  std::vector<refit::TensorDigests> rank_digests(captures_.size());
  // LiveWeights::InstallLive calls `fill` (on its pool's threads too) before it returns, while this thread
  // holds mu_: the lambda is REQUIRES(mu_) in that sense, which the analysis takes on trust.
  auto fill = [this, &bytes, touched, &rank_digests](int rank, ParameterStore* params) REQUIRES(mu_) -> Status {
    const size_t r = static_cast<size_t>(rank);
    if (r >= captures_.size()) return Internal("install: rank " + std::to_string(rank) + " has no capture");
    const auto& shadow = shadow_[r];
    refit::DestinationBuffers live;
    uint64_t rank_bytes = 0;
    for (const auto& [name, data] : shadow) {
      const Parameter* p = params->Find(name);
      if (p == nullptr) return Internal("staged parameter " + name + " is not an engine parameter");
      if (p->nbytes() != data->size()) return Internal("staged parameter " + name + " has the wrong size");
      live.emplace(name, std::span<std::byte>(p->bytes(), p->nbytes()));
      rank_bytes += p->nbytes();
    }
    // The first live byte is written below: from here on a failure is after mutation.
    touched->store(true);
    auto d = refit::CopyAndDigestInstalledParallel(captures_[r], shadow_buffers_[r], live, digest_regions_[r],
                                                   uncovered_[r], threads_);
    if (!d.ok()) return d.status().WithContext("installing rank " + std::to_string(rank));
    rank_digests[r] = std::move(d).value();
    bytes += rank_bytes;
    if (rank == 0 && fail_after_first_rank_.load()) {
      return FailedPrecondition("injected fault: install failed after rank 0 wrote its weights");
    }
    return OkStatus();
  };
  live_cache_valid_ = false;  // the live weights are about to change
  Status st = live_->InstallLive(fill, version, ++generation_, !skip_cache_reset, InstallWrites::kInPlace);
  if (!st.ok()) {
    return st.WithContext("install of " + version);
  }
  stages["install"] = MsSince(t);

  t = std::chrono::steady_clock::now();
  refit::TensorDigests live;
  for (const auto& d : rank_digests) refit::AddDigests(live, d);
  stages["post_install"] = MsSince(t);  // the digest was computed during the copy
  return FinishFullInstall(version, skip_cache_reset, live, bytes.load(), std::move(stages), InstallMode::kCopy);
}

StagePreReplay RefitReceiver::PreReplayLocked(std::chrono::steady_clock::time_point deadline) {
  const std::vector<refit::Probe>& probes = staged_->manifest.probes;
  StagePreReplay out;
  out.report.probes = static_cast<int64_t>(probes.size());
  if (probes.empty()) {
    out.report.why = "the version carries no probes";
    return out;
  }
  if (delta_staged_ && !delta_staged_->to_staging) {
    out.report.why = "the delta is written into the live weights at install (no staging image): nothing to replay "
                     "before the pause";
    return out;
  }
  if (!SwapCoversLive()) {
    out.report.why = "the staged image does not cover every live parameter read-only (the install copies): its "
                     "bytes are not what will be live";
    return out;
  }
  WeightImage image(shadow_buffers_.size());
  for (size_t r = 0; r < shadow_buffers_.size(); ++r) {
    for (const auto& [name, bytes] : shadow_buffers_[r]) image[r].emplace(name, std::span<const std::byte>(bytes));
  }
  std::vector<ReplayProbeRequest> requests;
  requests.reserve(probes.size());
  for (const refit::Probe& p : probes) {
    ReplayProbeRequest r{p.prompt, static_cast<int64_t>(p.steps.size()), p.top_k};
    // The trainer's recorded tokens: scored teacher-forced, one forward for every step.
    for (const refit::ProbeStep& st : p.steps) r.forced.push_back(st.token);
    requests.push_back(std::move(r));
  }
  const uint64_t id = ++prereplay_seq_;
  out.report = live_->PreReplay(image, id, requests, deadline);
  out.attempted = true;
  out.report.probes = static_cast<int64_t>(probes.size());  // what was asked, whatever the engine counted
  if (out.report.ran) {
    out.report.why = "ran on the staged image while the old version served";
    staged_->prereplay_image = id;
  }
  return out;
}

bool RefitReceiver::SwapCoversLive() {
  // Read-only since the stage's digest: the image the digest proved is the one swapped in.
  return StagingFitsLive(/*require_read_only=*/true);
}

Status RefitReceiver::SetShadowReadOnly(bool read_only) {
  for (auto& rank : shadow_) {
    for (auto& [name, buf] : rank) RC_RETURN_IF_ERROR(buf->SetReadOnly(read_only).WithContext("staging " + name));
  }
  return OkStatus();
}

std::span<std::byte> RefitReceiver::StagedBytesForTesting(int rank, const std::string& name) {
  rc::MutexLock lock(mu_);
  if (rank < 0 || static_cast<size_t>(rank) >= shadow_.size()) return {};
  auto it = shadow_[static_cast<size_t>(rank)].find(name);
  if (it == shadow_[static_cast<size_t>(rank)].end()) return {};
  return std::span<std::byte>(it->second->data(), it->second->size());
}

Result<InstallReport> RefitReceiver::FinishFullInstall(const std::string& version, bool skip_cache_reset,
                                                       const refit::TensorDigests& live, uint64_t bytes,
                                                       StepTimings stages, InstallMode mode) {
  live_cache_ = live;
  live_cache_generation_ = live_->InstallGeneration();
  live_cache_valid_ = true;
  std::string mismatch = refit::FirstDigestMismatch(live, staged_->published);
  if (!mismatch.empty()) {
    return DataLoss("live weights after installing " + version + " do not match the published digests: " + mismatch);
  }
  InstallReport out;
  out.stage = std::move(staged_->report);
  out.weight_version = version;
  out.bytes_installed = bytes;
  out.install_mode = mode;
  out.cache_reset = !skip_cache_reset;
  out.live_content_digest = ContentDigest(refit::CombineTensorDigests(live));
  out.anchor_check = FullInstallAnchor();
  stages["ready"] = 0.0;
  out.stages_ms = std::move(stages);
  installed_manifest_ = std::move(staged_->manifest);  // what a relay of the live version serves
  installed_model_ = staged_->model;
  staged_.reset();  // the shadow stays allocated for the next refit; a new stage is needed
  return out;
}

void RefitReceiver::WriteMetrics(MetricsWriter* out, const MetricLabels& labels) const {
  rc::MutexLock lock(metrics_mu_);
  auto metric = [&](const char* name, MetricType type, const char* help, auto value) {
    out->Metric(name, type, help, labels, value);
  };
  constexpr MetricType kCounter = MetricType::kCounter;
  metric("rolloutcore_refit_stages_total", kCounter, "Refit stages that completed (bytes staged and verified).",
         stages_ok_);
  metric("rolloutcore_refit_stages_failed_total", kCounter, "Refit stages that failed.", stages_failed_);
  metric("rolloutcore_refit_installs_total", kCounter, "Installs that completed with the digest verified.",
         installs_ok_);
  metric("rolloutcore_refit_installs_refused_total", kCounter,
         "Installs refused before touching live weights (not paused, nothing or another version staged).",
         installs_refused_);
  metric("rolloutcore_refit_installs_failed_total", kCounter, "Installs that failed after they began.",
         installs_failed_);
  metric("rolloutcore_refit_bytes_pulled_total", kCounter, "Bytes read by refit stages.", bytes_pulled_total_);
  metric("rolloutcore_refit_bytes_installed_total", kCounter, "Bytes copied into live parameters.",
         bytes_installed_total_);
  metric("rolloutcore_refit_wire_gbps", MetricType::kGauge, "Wire bandwidth of the last stage, GB/s.",
         last_wire_gbps_);
  out->Family("rolloutcore_refit_stage_ms", MetricType::kGauge,
              "Milliseconds per stage of the last refit (stage, then install).");
  StepTimings merged = last_stage_ms_;
  for (const auto& [k, v] : last_install_ms_) merged[k] = v;
  for (const auto& [k, v] : merged) out->Sample("rolloutcore_refit_stage_ms", WithLabel(labels, "stage", k), v);
}

Result<LiveDigestReport> RefitReceiver::LiveDigest(bool fresh) {
  rc::MutexLock lock(mu_);
  RC_RETURN_IF_ERROR(EnsureCaptures());
  const int64_t generation = live_->InstallGeneration();
  LiveDigestReport out;
  if (!fresh && live_cache_valid_ && live_cache_generation_ == generation) {
    out.tensors = live_cache_;
    out.computed = "at install, from the live parameters (install generation " + std::to_string(generation) + ")";
  } else {
    auto t = std::chrono::steady_clock::now();
    RC_ASSIGN_OR_RETURN(refit::TensorDigests live, DigestOf(LiveBuffers()));
    live_cache_ = live;
    live_cache_generation_ = generation;
    live_cache_valid_ = true;
    out.tensors = std::move(live);
    out.digest_ms = MsSince(t);
    out.computed = "now";
  }
  out.content_digest = ContentDigest(refit::CombineTensorDigests(out.tensors));
  out.weight_version = live_->WeightVersion();
  return out;
}

std::optional<std::string> RefitReceiver::CachedLiveDigest() const {
  // A stage or install in progress holds mu_: the cache is being replaced, report none.
  if (!mu_.try_lock()) return std::nullopt;
  rc::MutexLock lock(mu_, std::adopt_lock);
  if (!live_cache_valid_ || live_cache_generation_ != live_->InstallGeneration()) return std::nullopt;
  return Hex64(refit::CombineTensorDigests(live_cache_));
}

}  // namespace rc::receiver
