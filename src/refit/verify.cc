#include "rolloutcore/refit/verify.h"

#include <fmt/format.h>

#include <cstring>
#include <memory>
#include <numeric>
#include <unordered_map>

#include "refit/geometry.h"
#include "rolloutcore/base/hash.h"
#include "rolloutcore/refit/digest.h"
#include "rolloutcore/transport/local.h"

namespace rc::refit {
namespace {

constexpr std::byte kSentinel{0xA5};

void FillRandom(DType dt, uint64_t seed, std::byte* p, int64_t n) {
  const size_t es = DTypeSize(dt);
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t u = Mix64(seed + static_cast<uint64_t>(i));
    const float f = static_cast<float>(u >> 40) * 0x1p-24f * 4.0f - 2.0f;  // [-2, 2)
    std::byte* e = p + static_cast<size_t>(i) * es;
    switch (dt) {
      case DType::kF32: std::memcpy(e, &f, 4); break;
      case DType::kBF16: {
        const uint16_t b = F32ToBf16Bits(f);
        std::memcpy(e, &b, 2);
        break;
      }
      case DType::kF16: {
        const uint16_t h = F32ToF16Bits(f);
        std::memcpy(e, &h, 2);
        break;
      }
      default: std::memcpy(e, &u, es); break;
    }
  }
}

// Forwards only the copies of selected sources.
class SelectingContext final : public LoadContext {
 public:
  SelectingContext(LoadContext& inner, const Selector& selector) : inner_(inner), selector_(selector) {}
  Result<SourceView> Source(std::string_view name) override { return inner_.Source(name); }
  Status CopyInto(const SourceView& view, const DestRegion& dest) override {
    if (!selector_.Matches(view.name())) return OkStatus();
    return inner_.CopyInto(view, dest);
  }

 private:
  LoadContext& inner_;
  const Selector& selector_;
};

struct OwnedBuffers {
  std::vector<std::unique_ptr<std::byte[]>> storage;
  DestinationBuffers map;
};

OwnedBuffers AllocateParams(const std::vector<TensorSpec>& params) {
  OwnedBuffers b;
  for (const TensorSpec& p : params) {
    const size_t n = p.bytes();
    b.storage.push_back(std::make_unique_for_overwrite<std::byte[]>(n > 0 ? n : 1));
    std::memset(b.storage.back().get(), static_cast<int>(kSentinel), n);
    b.map.emplace(p.name, std::span<std::byte>(b.storage.back().get(), n));
  }
  return b;
}

// Deregisters local regions on scope exit.
struct Registrations {
  transport::Transport* t = nullptr;
  std::vector<uint64_t> ids;
  ~Registrations() {
    for (uint64_t id : ids) (void)t->Deregister(id);
  }
};

std::vector<int32_t> Identity(size_t n) {
  std::vector<int32_t> v(n);
  std::iota(v.begin(), v.end(), 0);
  return v;
}

// Copies `box` of a whole tensor into a dense buffer.
std::vector<std::byte> ExtractBox(DType dt, const Shape& shape, const std::byte* full, const Box& box) {
  std::vector<std::byte> out(static_cast<size_t>(box.numel()) * DTypeSize(dt));
  const std::vector<int32_t> id = Identity(shape.size());
  internal::CopyViewFromBlock(dt, full, FullBox(shape), box, id, dt, out.data(), 0, RowMajorStrides(box.extent));
  return out;
}

bool Narrowing(DType from, DType to) {
  return from == DType::kF32 && (to == DType::kBF16 || to == DType::kF16);
}

}  // namespace

bool VerifyReport::verified() const {
  if (!digests_match) return false;
  for (const auto& r : ranks) {
    if (!r.bytes_equal) return false;
  }
  return !ranks.empty();
}

Result<VerifyProblem> ModelVerifyProblem(const ModelConfig& config, const TrainerLayout& source,
                                         const EngineLayout& target) {
  RC_ASSIGN_OR_RETURN(Manifest m, MakeTrainerManifest(config, source));
  RC_RETURN_IF_ERROR(CheckEngineLayout(config, target));
  VerifyProblem p;
  p.tables = std::move(m.tables);
  p.ranks = target.world_size();
  p.params = [config, target](int32_t rank) { return ListEngineParams(config, target, rank); };
  p.load = [config, target](int32_t rank, LoadContext& ctx) { return LoadEngineRank(config, target, rank, ctx); };
  return p;
}

VerifyProblem SpecVerifyProblem(const PlanSpec& spec) {
  VerifyProblem p;
  p.tables = spec.tensors;
  p.ranks = 1;
  p.params = [spec](int32_t) -> Result<std::vector<TensorSpec>> { return SpecParams(spec); };
  p.load = [spec](int32_t, LoadContext& ctx) { return LoadSpecTargets(spec, ctx); };
  return p;
}

Result<VerifyReport> Verify(const VerifyProblem& pb, const VerifyOptions& opt) {
  std::vector<int32_t> ranks = opt.ranks;
  if (ranks.empty()) {
    for (int32_t r = 0; r < pb.ranks; ++r) ranks.push_back(r);
  }
  // Size check before allocating anything.
  uint64_t total = 0;
  for (const ShardTable& t : pb.tables) {
    RC_RETURN_IF_ERROR(ValidateShardTable(t, /*require_complete=*/false));
    total += 2 * t.spec().bytes();
  }
  std::vector<std::vector<TensorSpec>> params;
  for (int32_t r : ranks) {
    if (r < 0 || r >= pb.ranks) return InvalidArgument(fmt::format("rank {} is outside 0..{}", r, pb.ranks - 1));
    RC_ASSIGN_OR_RETURN(std::vector<TensorSpec> p, pb.params(r));
    for (const TensorSpec& s : p) total += 2 * s.bytes();
    params.push_back(std::move(p));
  }
  if (total > opt.max_bytes) {
    return FailedPrecondition(fmt::format("verify needs {} MiB of buffers, above the limit of {} MiB; use a smaller model",
                                          total >> 20, opt.max_bytes >> 20));
  }

  // Sources: whole tensors, then shards cut out of them and registered.
  RC_ASSIGN_OR_RETURN(std::unique_ptr<transport::Transport> tp, transport::CreateLocalTransport());
  Registrations regs{tp.get(), {}};
  std::unordered_map<std::string, std::vector<std::byte>> full;
  std::vector<std::vector<std::byte>> shard_bytes;
  Manifest m;
  m.model = "verify";
  m.version = fmt::format("seed-{}", opt.seed);
  m.tables = pb.tables;
  for (ShardTable& t : m.tables) {
    auto& bytes = full[t.name];
    bytes.resize(t.spec().bytes());
    FillRandom(t.dtype, opt.seed ^ Hash64(t.name), bytes.data(), NumElements(t.shape));
    for (ShardInfo& s : t.shards) {
      const Box box = s.box();
      if (box.numel() == 0) continue;
      shard_bytes.push_back(ExtractBox(t.dtype, t.shape, bytes.data(), box));
      const auto& sb = shard_bytes.back();
      RC_ASSIGN_OR_RETURN(transport::Registration reg, tp->RegisterMemory({sb.data(), sb.size()}));
      regs.ids.push_back(reg.id);
      s.handle = reg.descriptor;
      s.digest = DigestBlock(t.dtype, t.shape, box, sb.data());
      m.expected_ranks = std::max(m.expected_ranks, s.rank + 1);
    }
  }
  RC_ASSIGN_OR_RETURN(TensorDigests published, TensorDigestsFromShards(m));
  std::unordered_map<std::string, const ShardTable*> table_by_name;
  for (const ShardTable& t : m.tables) table_by_name.emplace(t.name, &t);
  VerifyReport report;
  report.content_digest = CombineTensorDigests(published);

  std::vector<TensorSpec> sources;
  for (const ShardTable& t : m.tables) sources.push_back(t.spec());
  auto lookup = [&](std::string_view name) -> Result<HostTensor> {
    auto it = table_by_name.find(std::string(name));
    if (it == table_by_name.end()) return NotFound(fmt::format("source tensor {} is not known", name));
    const auto& bytes = full.at(it->second->name);
    return HostTensor{it->second->dtype, it->second->shape, std::span<const std::byte>(bytes.data(), bytes.size())};
  };

  std::vector<Capture> captures;
  std::vector<OwnedBuffers> installed;
  for (size_t i = 0; i < ranks.size(); ++i) {
    const int32_t r = ranks[i];
    CaptureContext cc(sources, params[i]);
    RC_RETURN_IF_ERROR(pb.load(r, cc));
    captures.push_back(cc.Take());
    PlanOptions po = opt.plan;
    po.dest_rank = r;
    RC_ASSIGN_OR_RETURN(TransferPlan plan, BuildPlan(captures.back(), m, po));
    RankVerification rv;
    rv.rank = r;
    rv.plan = plan.stats;
    installed.push_back(AllocateParams(params[i]));
    RC_ASSIGN_OR_RETURN(rv.execute, ExecutePlan(plan, *tp, installed.back().map, opt.execute));

    OwnedBuffers ref = AllocateParams(params[i]);
    MaterializeContext mc(lookup, params[i], ref.map);
    SelectingContext sc(mc, opt.plan.selector);
    RC_RETURN_IF_ERROR(pb.load(r, sc));
    if (opt.plan.selector.empty()) RC_RETURN_IF_ERROR(mc.CheckCoverage());
    rv.bytes_equal = true;
    for (const TensorSpec& p : params[i]) {
      const auto a = installed.back().map.at(p.name);
      const auto b = ref.map.at(p.name);
      if (std::memcmp(a.data(), b.data(), a.size()) != 0) {
        size_t k = 0;
        while (a[k] == b[k]) ++k;
        rv.bytes_equal = false;
        rv.mismatch = fmt::format("rank {} parameter {}: byte {} differs (plan {:#04x}, reference {:#04x})", r, p.name,
                                  k, static_cast<unsigned>(a[k]), static_cast<unsigned>(b[k]));
        break;
      }
    }
    report.ranks.push_back(std::move(rv));
  }

  // Digests of what was installed, each source box once.
  std::vector<const Capture*> cap_ptrs;
  for (const Capture& c : captures) cap_ptrs.push_back(&c);
  const auto owned = AssignDigestOwnership(cap_ptrs);
  TensorDigests engine;
  std::unordered_map<std::string, int64_t> installed_elems;
  std::unordered_map<std::string, bool> skip;
  std::vector<std::vector<DigestRegion>> selected(captures.size());
  for (size_t i = 0; i < captures.size(); ++i) {
    for (const DigestRegion& region : owned[i]) {
      const CapturedCopy& c = captures[i].copies[region.copy];
      if (!opt.plan.selector.Matches(c.source)) continue;
      selected[i].push_back(region);
      installed_elems[c.source] += region.box.numel();
      if (Narrowing(c.source_dtype, captures[i].params[c.param].dtype)) skip[c.source] = true;
    }
    RC_ASSIGN_OR_RETURN(TensorDigests d, DigestInstalled(captures[i], installed[i].map, selected[i]));
    AddDigests(engine, d);
  }
  report.digests_match = true;
  for (const auto& [name, got] : engine) {
    if (skip.count(name)) continue;
    const ShardTable& t = *table_by_name.at(name);
    uint64_t want = 0;
    if (installed_elems[name] == NumElements(t.shape)) {
      want = published.at(name);
    } else {
      for (size_t i = 0; i < captures.size(); ++i) {
        for (const DigestRegion& region : selected[i]) {
          if (captures[i].copies[region.copy].source != name) continue;
          const auto box = ExtractBox(t.dtype, t.shape, full.at(name).data(), region.box);
          want += DigestBlock(t.dtype, t.shape, region.box, box.data());
        }
      }
    }
    report.tensors_compared++;
    if (got != want && report.digests_match) {
      report.digests_match = false;
      report.digest_mismatch =
          fmt::format("tensor {}: installed digest {} but published {}", name, Hex64(got), Hex64(want));
    }
  }
  return report;
}

}  // namespace rc::refit
