#include "refit/landing_digest.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "rolloutcore/refit/digest.h"
#include "rolloutcore/refit/layouts.h"
#include "rolloutcore/refit/model_config.h"

namespace rc::refit {
namespace {

const std::string kEmbed = "model.embed_tokens.weight";

// One engine rank of the tiny model (tp 1 or 2) with its digest regions, uncovered bytes and
// staged buffers filled with finite bf16 values.
struct Rank {
  std::vector<Capture> captures;
  std::vector<std::vector<DigestRegion>> regions;
  std::vector<UncoveredBytes> uncovered;
  std::vector<std::vector<std::byte>> storage;
  std::vector<DestinationBuffers> buffers;
  std::vector<TransferPlan> plans;

  explicit Rank(int tp, DType dtype = DType::kBF16) {
    EngineLayout layout;
    layout.tp = tp;
    layout.param_dtype = dtype;
    ModelConfig config = ModelPreset("tiny").value();
    config.dtype = dtype;  // the source in the parameters' dtype: lands as bytes
    for (int r = 0; r < tp; ++r) captures.push_back(CaptureEngineRank(config, layout, r).value());
    std::vector<const Capture*> ptrs;
    for (const auto& c : captures) ptrs.push_back(&c);
    regions = AssignDigestOwnership(ptrs);
    std::mt19937 rng(11);
    for (size_t r = 0; r < captures.size(); ++r) {
      uncovered.push_back(BytesOutsideRegions(captures[r], regions[r]).value());
      buffers.emplace_back();
      for (const TensorSpec& p : captures[r].params) storage.emplace_back(p.bytes());
    }
    size_t k = 0;
    for (size_t r = 0; r < captures.size(); ++r) {
      for (const TensorSpec& p : captures[r].params) {
        std::vector<std::byte>& s = storage[k++];
        for (size_t i = 0; i + 1 < s.size(); i += 2) {
          // Finite in bf16 and f32 alike: the exponent's top bit stays clear.
          const auto v = static_cast<uint16_t>(rng() & 0x3fff);
          std::memcpy(s.data() + i, &v, 2);
        }
        buffers[r].emplace(p.name, std::span<std::byte>(s.data(), s.size()));
      }
    }
    plans.resize(captures.size());
  }

  LandingDigest Make() const { return LandingDigest(captures, regions, uncovered, buffers, plans); }

  // DigestInstalled over every region, all ranks.
  TensorDigests Full() const {
    TensorDigests out;
    for (size_t r = 0; r < captures.size(); ++r) AddDigests(out, DigestInstalled(captures[r], buffers[r], regions[r]).value());
    return out;
  }
  // DigestInstalled over the regions of the parameters in `fallback`.
  TensorDigests Rest(const std::set<std::pair<size_t, std::string>>& fallback) const {
    TensorDigests out;
    for (size_t r = 0; r < captures.size(); ++r) {
      std::vector<DigestRegion> rest;
      for (const DigestRegion& reg : regions[r]) {
        if (fallback.contains({r, captures[r].params[captures[r].copies[reg.copy].param].name})) rest.push_back(reg);
      }
      AddDigests(out, DigestInstalled(captures[r], buffers[r], rest).value());
    }
    return out;
  }
  // Reports every parameter of rank r in `chunk`-byte pieces, shuffled, from two threads.
  void LandAll(LandingDigest& d, uint64_t chunk, const std::string& skip_param = "", uint64_t skip_at = 0) const {
    std::vector<std::pair<std::byte*, uint64_t>> pieces;
    for (const auto& b : buffers) {
      for (const auto& [name, span] : b) {
        for (uint64_t at = 0; at < span.size(); at += chunk) {
          if (name == skip_param && at == skip_at) continue;
          pieces.emplace_back(span.data() + at, std::min<uint64_t>(chunk, span.size() - at));
        }
      }
    }
    std::shuffle(pieces.begin(), pieces.end(), std::mt19937(5));
    std::thread other([&] {
      for (size_t i = 0; i < pieces.size(); i += 2) d.Landed(pieces[i].first, pieces[i].second);
    });
    for (size_t i = 1; i < pieces.size(); i += 2) d.Landed(pieces[i].first, pieces[i].second);
    other.join();
  }
};

TEST(LandingDigest, WholeLandedParametersSumToTheStagedDigestAndTheRestFallsBack) {
  for (int tp : {1, 2}) {
    SCOPED_TRACE(tp);
    Rank rank(tp);
    LandingDigest d = rank.Make();
    ASSERT_GT(d.eligible(), 0u);
    rank.LandAll(d, 4096 + 64);
    LandingDigest::Outcome out = d.Finish();
    EXPECT_FALSE(out.nonfinite);
    size_t params = 0;
    for (const auto& c : rank.captures) params += c.params.size();
    EXPECT_EQ(params - out.fallback.size(), d.eligible()) << "every eligible parameter landed whole";
    if (tp == 1) {
      // tp 1: every tiny parameter is whole tensors, one or several side by side (the fused
      // qkv_proj and gate_up_proj).
      EXPECT_TRUE(out.fallback.empty());
    } else {
      EXPECT_FALSE(out.fallback.empty()) << "tp 2: sharded parameters are left to the digest pass";
    }
    TensorDigests got = out.digests;
    AddDigests(got, rank.Rest(out.fallback));
    EXPECT_EQ(got, rank.Full());
  }
}

TEST(LandingDigest, DigestsTheStagedBytesNotWhatWasMeantToLand) {
  Rank rank(1);
  const TensorDigests clean = rank.Full();
  // A byte changed in staging (after the copy, before the observer reads it back) is in the digest.
  rank.buffers[0].at(kEmbed)[6] ^= std::byte{0x01};
  LandingDigest d = rank.Make();
  rank.LandAll(d, 1 << 16);
  LandingDigest::Outcome out = d.Finish();
  ASSERT_FALSE(out.fallback.contains({0, kEmbed}));
  AddDigests(out.digests, rank.Rest(out.fallback));
  EXPECT_EQ(out.digests, rank.Full());
  EXPECT_NE(out.digests, clean);
  EXPECT_FALSE(FirstDigestMismatch(out.digests, clean).empty());
}

TEST(LandingDigest, AParameterNotTiledExactlyIsLeftToTheDigestPass) {
  Rank rank(1);
  const std::string victim = kEmbed;
  ASSERT_GT(rank.buffers[0].at(victim).size(), 8192u);
  const size_t base = rank.captures[0].params.size() - rank.Make().eligible();  // never eligible
  {
    LandingDigest d = rank.Make();
    rank.LandAll(d, 4096, victim, 4096);  // one chunk never reported
    LandingDigest::Outcome out = d.Finish();
    EXPECT_TRUE(out.fallback.contains({0, victim}));
    EXPECT_EQ(out.fallback.size(), base + 1);
    EXPECT_FALSE(out.digests.contains(victim));
  }
  {
    LandingDigest d = rank.Make();
    rank.LandAll(d, 4096);
    d.Landed(rank.buffers[0].at(victim).data(), 4096);  // reported twice: overlapping writes
    EXPECT_EQ(d.Finish().fallback.size(), base + 1);
  }
  {
    LandingDigest d = rank.Make();
    rank.LandAll(d, 4096, victim, 0);
    std::byte* p = rank.buffers[0].at(victim).data();
    d.Landed(p, 1);  // split at an odd byte: the element straddles two reports
    d.Landed(p + 1, 4095);
    EXPECT_EQ(d.Finish().fallback.size(), base + 1);
  }
  {
    LandingDigest d = rank.Make();
    rank.LandAll(d, 4096);
    d.Reset();  // forgets everything
    EXPECT_EQ(d.Finish().fallback.size(), rank.captures[0].params.size());
  }
}

TEST(LandingDigest, ANonFiniteLandedElementIsReported) {
  for (DType dtype : {DType::kBF16, DType::kF32}) {
    Rank rank(1, dtype);
    std::span<std::byte> span = rank.buffers[0].at(kEmbed);
    const uint32_t nan = dtype == DType::kBF16 ? 0x7fc0u : 0x7fc00000u;
    std::memcpy(span.data() + span.size() - DTypeSize(dtype), &nan, DTypeSize(dtype));
    LandingDigest d = rank.Make();
    rank.LandAll(d, 4096);
    EXPECT_TRUE(d.Finish().nonfinite) << DTypeName(dtype);
  }
}

// Lands every chunk of `from`'s buffers into `to`'s the way the shm transport does: the copy is
// offered to the observer first, and copied and reported when declined.
void CopyLandAll(LandingDigest& d, const Rank& from, Rank& to, uint64_t chunk) {
  for (size_t r = 0; r < from.buffers.size(); ++r) {
    for (const auto& [name, span] : from.buffers[r]) {
      std::span<std::byte> dst = to.buffers[r].at(name);
      for (uint64_t at = 0; at < span.size(); at += chunk) {
        const uint64_t n = std::min<uint64_t>(chunk, span.size() - at);
        if (!d.CopyLanded(dst.data() + at, span.data() + at, n)) {
          std::memcpy(dst.data() + at, span.data() + at, n);
          d.Landed(dst.data() + at, n);
        }
      }
    }
  }
}

// The name of a parameter of rank r whose every byte is a replica byte (no digest region), or "".
std::string WholeReplica(const Rank& rank, size_t r) {
  for (const TensorSpec& p : rank.captures[r].params) {
    auto it = rank.uncovered[r].find(p.name);
    if (it == rank.uncovered[r].end()) continue;
    uint64_t bytes = 0;
    for (const ByteRange& br : it->second) bytes += br.end - br.begin;
    if (bytes == p.bytes()) return p.name;
  }
  return "";
}

TEST(LandingDigest, OfferedTheCopyItCopiesDigestsAndScansReplicasInOnePass) {
  for (DType dtype : {DType::kBF16, DType::kF32}) {
    for (int tp : {1, 2}) {
      SCOPED_TRACE(std::string(DTypeName(dtype)) + " tp " + std::to_string(tp));
      const Rank src(tp, dtype);
      Rank dst(tp, dtype);
      for (auto& s : dst.storage) std::fill(s.begin(), s.end(), std::byte{0xee});
      LandingDigest d = dst.Make();
      CopyLandAll(d, src, dst, 4096 + 64);
      LandingDigest::Outcome out = d.Finish();
      EXPECT_FALSE(out.nonfinite);
      EXPECT_EQ(dst.storage, src.storage) << "every byte landed, declined chunks included";
      size_t params = 0;
      for (const auto& c : dst.captures) params += c.params.size();
      EXPECT_EQ(params - out.fallback.size(), d.eligible());
      EXPECT_EQ(out.scanned_only, d.scan_only_eligible());
      if (tp == 2) {
        EXPECT_GT(d.scan_only_eligible(), 0u) << "tp 2 replicates the norms: one rank's copies are replicas";
      }
      TensorDigests got = out.digests;
      AddDigests(got, dst.Rest(out.fallback));
      EXPECT_EQ(got, src.Full());
    }
  }
}

TEST(LandingDigest, ANonFiniteReplicaElementIsFoundWhileItLands) {
  for (bool offered : {true, false}) {
    SCOPED_TRACE(offered ? "copy offered" : "landed");
    Rank src(2);
    const std::string replica = WholeReplica(src, 1);
    ASSERT_FALSE(replica.empty());
    Rank dst(2);
    {
      LandingDigest d = offered ? dst.Make() : src.Make();
      offered ? CopyLandAll(d, src, dst, 4096) : src.LandAll(d, 4096);
      LandingDigest::Outcome out = d.Finish();
      EXPECT_FALSE(out.nonfinite);
      EXPECT_FALSE(out.fallback.contains({1, replica})) << "scanned on landing, not left to the caller";
    }
    std::span<std::byte> span = src.buffers[1].at(replica);
    const uint16_t inf = 0x7f80;
    std::memcpy(span.data() + span.size() - 2, &inf, 2);
    LandingDigest d = offered ? dst.Make() : src.Make();
    offered ? CopyLandAll(d, src, dst, 4096) : src.LandAll(d, 4096);
    EXPECT_TRUE(d.Finish().nonfinite);
  }
}

TEST(LandingDigest, ParametersAnInstallStepWritesAreNotEligible) {
  Rank rank(1);
  const size_t all = rank.Make().eligible();
  PlanBuffer b;
  b.name = rank.captures[0].params[0].name;
  rank.plans[0].buffers.push_back(b);
  InstallStep s;
  s.param = 0;
  rank.plans[0].installs.push_back(s);
  EXPECT_EQ(rank.Make().eligible(), all - 1);
}

}  // namespace
}  // namespace rc::refit
