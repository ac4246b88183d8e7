#include "refit/landing_digest.h"

#include <algorithm>

#include "refit/digest_simd.h"

namespace rc::refit {
namespace {

bool RowMajorContiguous(const CapturedCopy& c) {
  const size_t n = c.box.ndim();
  if (c.view_to_source.size() != n || c.dest_shape.size() != n || c.dest_strides.size() != n) return false;
  int64_t stride = 1;
  for (size_t k = n; k-- > 0;) {
    if (c.view_to_source[k] != static_cast<int32_t>(k) || c.dest_shape[k] != c.box.extent[k]) return false;
    if (c.box.extent[k] > 1 && c.dest_strides[k] != stride) return false;
    stride *= c.box.extent[k];
  }
  return true;
}

bool WholeTensor(const CapturedCopy& c) {
  if (c.source_shape.size() != c.box.ndim()) return false;
  for (size_t k = 0; k < c.box.ndim(); ++k) {
    if (c.box.start[k] != 0 || c.box.extent[k] != c.source_shape[k]) return false;
  }
  return true;
}

// True when the [begin, end) pieces, sorted, tile [0, bytes) exactly (bytes > 0).
bool Tiles(std::vector<std::pair<uint64_t, uint64_t>> pieces, uint64_t bytes) {
  std::sort(pieces.begin(), pieces.end());
  uint64_t at = 0;
  for (const auto& [b, e] : pieces) {
    if (b != at) return false;
    at = e;
  }
  return bytes > 0 && at == bytes;
}

}  // namespace

LandingDigest::LandingDigest(std::span<const Capture> captures, std::span<const std::vector<DigestRegion>> regions,
                             std::span<const UncoveredBytes> uncovered, std::span<const DestinationBuffers> buffers,
                             std::span<const TransferPlan> plans)
    : captures_(captures) {
  const size_t ranks = std::min({captures.size(), regions.size(), uncovered.size(), buffers.size(), plans.size()});
  for (size_t r = 0; r < ranks; ++r) {
    const Capture& cap = captures[r];
    std::set<std::string, std::less<>> installed;  // parameters an install step writes
    for (const InstallStep& s : plans[r].installs) {
      if (s.param < plans[r].buffers.size()) installed.insert(plans[r].buffers[s.param].name);
    }
    // Per parameter, the whole-tensor segments its regions make; a parameter with a region that
    // is not one is out.
    std::vector<std::vector<std::unique_ptr<Segment>>> segments(cap.params.size());
    std::vector<bool> out(cap.params.size(), false);
    for (const DigestRegion& reg : regions[r]) {
      if (reg.copy >= cap.copies.size() || cap.copies[reg.copy].param >= cap.params.size()) continue;
      const CapturedCopy& c = cap.copies[reg.copy];
      const TensorSpec& param = cap.params[c.param];
      // Same dtype: the digest of the installed bits is the raw digest (no widening to map back).
      // (`convert` only says the loader may convert; the plan decides: only direct runs, which
      // land source bytes unchanged, write an eligible parameter.)
      if (c.source_dtype != param.dtype || (param.dtype != DType::kBF16 && param.dtype != DType::kF32) ||
          !(reg.box == c.box) || !WholeTensor(c) || !RowMajorContiguous(c) || c.dest_offset < 0 ||
          c.box.numel() == 0) {
        out[c.param] = true;
        continue;
      }
      const uint64_t es = DTypeSize(param.dtype);
      auto seg = std::make_unique<Segment>();
      seg->tensor = c.source;
      seg->begin = static_cast<uint64_t>(c.dest_offset) * es;
      seg->end = seg->begin + static_cast<uint64_t>(c.box.numel()) * es;
      segments[c.param].push_back(std::move(seg));
    }
    for (size_t k = 0; k < cap.params.size(); ++k) {
      const TensorSpec& param = cap.params[k];
      if (out[k] || installed.contains(param.name)) continue;
      auto it = buffers[r].find(param.name);
      if (it == buffers[r].end() || it->second.size() != param.bytes()) continue;
      // A replica (no digest region: every byte uncovered) is scanned on landing; a parameter of
      // whole-tensor segments is digested on landing. Either way its pieces must tile it.
      std::vector<std::pair<uint64_t, uint64_t>> pieces;
      if (segments[k].empty()) {
        auto u = uncovered[r].find(param.name);
        if (u == uncovered[r].end() || (param.dtype != DType::kBF16 && param.dtype != DType::kF32)) continue;
        for (const ByteRange& br : u->second) pieces.emplace_back(br.begin, br.end);
      } else {
        if (uncovered[r].contains(param.name)) continue;
        std::sort(segments[k].begin(), segments[k].end(), [](const auto& a, const auto& b) { return a->begin < b->begin; });
        for (const auto& seg : segments[k]) pieces.emplace_back(seg->begin, seg->end);
      }
      if (!Tiles(std::move(pieces), param.bytes())) continue;
      auto p = std::make_unique<Param>();
      p->rank = r;
      p->name = param.name;
      p->dtype = param.dtype;
      p->begin = it->second.data();
      p->bytes = it->second.size();
      p->segments = std::move(segments[k]);
      params_.push_back(std::move(p));
    }
  }
  std::sort(params_.begin(), params_.end(), [](const auto& a, const auto& b) { return a->begin < b->begin; });
}

void LandingDigest::Reset() {
  for (auto& p : params_) {
    for (auto& seg : p->segments) seg->sum.store(0, std::memory_order_relaxed);
    p->nonfinite.store(false, std::memory_order_relaxed);
    p->misaligned.store(false, std::memory_order_relaxed);
    rc::MutexLock lock(p->mu);
    p->chunks.clear();
  }
}

size_t LandingDigest::scan_only_eligible() const {
  return static_cast<size_t>(
      std::count_if(params_.begin(), params_.end(), [](const auto& p) { return p->segments.empty(); }));
}

LandingDigest::Param* LandingDigest::Find(const std::byte* dest, uint64_t length) const {
  if (length == 0 || params_.empty()) return nullptr;
  auto it = std::upper_bound(params_.begin(), params_.end(), dest,
                             [](const std::byte* d, const auto& p) { return d < p->begin; });
  if (it == params_.begin()) return nullptr;
  Param& p = **std::prev(it);
  const auto offset = static_cast<uint64_t>(dest - p.begin);
  if (offset >= p.bytes || length > p.bytes - offset) return nullptr;  // not (wholly) in an eligible parameter
  return &p;
}

void LandingDigest::Landed(std::byte* dest, uint64_t length) { (void)Observe(dest, nullptr, length); }

bool LandingDigest::CopyLanded(std::byte* dest, const std::byte* src, uint64_t length) {
  return Observe(dest, src, length);
}

bool LandingDigest::Observe(std::byte* dest, const std::byte* src, uint64_t length) {
  Param* found = Find(dest, length);
  if (found == nullptr) return false;
  Param& p = *found;
  const auto offset = static_cast<uint64_t>(dest - p.begin);
  const uint64_t es = DTypeSize(p.dtype);
  if (offset % es != 0 || length % es != 0) {
    p.misaligned.store(true, std::memory_order_relaxed);
    return false;  // a copy offered is declined: the transport copies it and calls Landed, which lands here
  }
  // Offered the copy: one pass that copies, digests the registers it stores and checks them for
  // NaN/Inf (CopyDigestAndScan). Not offered: the bytes are in cache at dest; digested and scanned
  // from there (the staged bytes, never the source), in L1-sized pieces.
  constexpr uint64_t kPiece = 16 << 10;
  const bool bf16 = p.dtype == DType::kBF16;
  const int esi = static_cast<int>(es);
  bool bad = false;
  auto scan = [&](const std::byte* at, uint64_t n) {
    const auto count = static_cast<int64_t>(n / es);
    bad = bad || (bf16 ? internal::AnyNonFiniteBf16(at, count) : internal::AnyNonFiniteF32(at, count));
  };
  const uint64_t end = offset + length;
  if (p.segments.empty()) {  // a replica: the finite check only (the digest of the copy is dropped)
    if (src != nullptr) {
      (void)internal::CopyDigestAndScan(esi, dest, src, 0, static_cast<int64_t>(length / es), &bad);
    } else {
      for (uint64_t at = 0; at < length; at += kPiece) scan(dest + at, std::min(kPiece, length - at));
    }
  } else {
    auto seg = std::upper_bound(p.segments.begin(), p.segments.end(), offset,
                                [](uint64_t o, const auto& sg) { return o < sg->begin; });
    for (--seg; seg != p.segments.end() && (*seg)->begin < end; ++seg) {
      Segment& sg = **seg;
      const uint64_t b = std::max(offset, sg.begin), e = std::min(end, sg.end);
      uint64_t sum = 0;
      if (src != nullptr) {
        sum = internal::CopyDigestAndScan(esi, dest + (b - offset), src + (b - offset), (b - sg.begin) / es,
                                          static_cast<int64_t>((e - b) / es), &bad);
      } else {
        for (uint64_t at = b; at < e; at += kPiece) {
          const uint64_t n = std::min(kPiece, e - at);
          const std::byte* d = dest + (at - offset);
          sum += internal::DigestContiguous(esi, d, (at - sg.begin) / es, static_cast<int64_t>(n / es));
          scan(d, n);
        }
      }
      sg.sum.fetch_add(sum, std::memory_order_relaxed);
    }
  }
  if (bad) p.nonfinite.store(true, std::memory_order_relaxed);
  rc::MutexLock lock(p.mu);
  p.chunks.emplace_back(offset, end);
  return src != nullptr;
}

LandingDigest::Outcome LandingDigest::Finish() {
  Outcome out;
  std::set<std::pair<size_t, std::string>> accepted;
  for (auto& p : params_) {
    std::vector<std::pair<uint64_t, uint64_t>> chunks;
    {
      rc::MutexLock lock(p->mu);
      chunks = p->chunks;
    }
    if (p->misaligned.load(std::memory_order_relaxed) || !Tiles(std::move(chunks), p->bytes)) continue;
    if (p->segments.empty()) ++out.scanned_only;
    for (const auto& seg : p->segments) out.digests[seg->tensor] += seg->sum.load(std::memory_order_relaxed);
    if (p->nonfinite.load(std::memory_order_relaxed)) out.nonfinite = true;
    accepted.emplace(p->rank, p->name);
  }
  for (size_t r = 0; r < captures_.size(); ++r) {
    for (const TensorSpec& param : captures_[r].params) {
      if (!accepted.contains({r, param.name})) out.fallback.emplace(r, param.name);
    }
  }
  return out;
}

}  // namespace rc::refit
