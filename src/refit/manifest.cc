#include "rolloutcore/refit/manifest.h"

#include <fmt/format.h>

#include <algorithm>
#include <set>

#include "refit/geometry.h"
#include "refit/shard_index.h"
#include "rolloutcore/base/content_digest.h"
#include "rolloutcore/base/hash.h"
#include "rolloutcore/refit/digest.h"

namespace rc::refit {

namespace internal {

Status IndexShards(const ShardTable& t, ShardIndex* out) {
  out->order.clear();
  out->boxes.clear();
  RC_RETURN_IF_ERROR(ValidateShape(t.shape, fmt::format("tensor {}", t.name)));
  const size_t n = t.shape.size();
  std::vector<uint32_t>& order = out->order;
  order.reserve(t.shards.size());
  for (uint32_t i = 0; i < t.shards.size(); ++i) {
    const ShardInfo& s = t.shards[i];
    if (s.offset.size() != n || s.shape.size() != n) {
      return InvalidArgument(fmt::format("tensor {}: shard of rank {} has offset {} and shape {} for a {}-d tensor",
                                         t.name, s.rank, ShapeToString(s.offset), ShapeToString(s.shape), n));
    }
    if (s.rank < 0) return InvalidArgument(fmt::format("tensor {}: shard with negative rank {}", t.name, s.rank));
    bool empty = false;
    for (size_t d = 0; d < n; ++d) {
      if (s.offset[d] < 0 || s.shape[d] < 0 || s.offset[d] > t.shape[d] || s.shape[d] > t.shape[d] - s.offset[d]) {
        return InvalidArgument(fmt::format(
            "tensor {}: shard of rank {} at offset {} shape {} lies outside the tensor shape {}", t.name, s.rank,
            ShapeToString(s.offset), ShapeToString(s.shape), ShapeToString(t.shape)));
      }
      empty = empty || s.shape[d] == 0;
    }
    if (!empty) order.push_back(i);
  }
  std::sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) {
    const ShardInfo& x = t.shards[a];
    const ShardInfo& y = t.shards[b];
    if (x.offset != y.offset) return x.offset < y.offset;
    if (x.shape != y.shape) return x.shape < y.shape;
    return a < b;
  });
  auto& boxes = out->boxes;
  boxes.reserve(order.size());
  for (uint32_t k = 0; k < order.size(); ++k) {
    const ShardInfo& s = t.shards[order[k]];
    if (!boxes.empty() && *boxes.back().start == s.offset && *boxes.back().extent == s.shape) {
      boxes.back().count++;
    } else {
      boxes.push_back(UniqueBox{&s.offset, &s.shape, k, 1});
    }
  }
  if (n == 0) return OkStatus();
  Box overlap;
  for (size_t i = 0; i < boxes.size(); ++i) {
    const int64_t end0 = (*boxes[i].start)[0] + (*boxes[i].extent)[0];
    for (size_t j = i + 1; j < boxes.size() && (*boxes[j].start)[0] < end0; ++j) {
      if (Intersect(boxes[i], boxes[j].box(), &overlap)) {
        return InvalidArgument(fmt::format("tensor {}: shards of rank {} {} and rank {} {} overlap at {}", t.name,
                                           t.shards[order[boxes[i].first]].rank, BoxToString(boxes[i].box()),
                                           t.shards[order[boxes[j].first]].rank, BoxToString(boxes[j].box()),
                                           BoxToString(overlap)));
      }
    }
  }
  return OkStatus();
}

bool Intersect(const UniqueBox& a, const Box& b, Box* out) {
  const size_t n = b.ndim();
  out->start.resize(n);
  out->extent.resize(n);
  bool nonempty = true;
  for (size_t d = 0; d < n; ++d) {
    const int64_t as = (*a.start)[d];
    const int64_t lo = std::max(as, b.start[d]);
    const int64_t hi = std::min(as + (*a.extent)[d], b.start[d] + b.extent[d]);
    out->start[d] = lo;
    out->extent[d] = hi > lo ? hi - lo : 0;
    nonempty = nonempty && hi > lo;
  }
  return nonempty;
}

bool IsDim0Partition(const Shape& shape, const ShardIndex& index) {
  if (shape.empty() || index.boxes.empty()) return false;
  int64_t cursor = 0;
  for (const UniqueBox& u : index.boxes) {
    if ((*u.start)[0] != cursor) return false;
    for (size_t d = 1; d < shape.size(); ++d) {
      if ((*u.start)[d] != 0 || (*u.extent)[d] != shape[d]) return false;
    }
    cursor += (*u.extent)[0];
  }
  return cursor == shape[0];
}

}  // namespace internal

Status ValidateShardTable(const ShardTable& table, bool require_complete) {
  internal::ShardIndex index;
  RC_RETURN_IF_ERROR(internal::IndexShards(table, &index));
  if (require_complete) {
    std::vector<Box> have;
    have.reserve(index.boxes.size());
    for (const auto& u : index.boxes) have.push_back(u.box());
    const std::string missing = internal::DescribeMissing(FullBox(table.shape), have);
    if (!missing.empty()) {
      return InvalidArgument(fmt::format("tensor {}: {} missing from the published shards", table.name, missing));
    }
  }
  return OkStatus();
}

Status CheckDigestAlgorithm(const Manifest& m) {
  if (m.digest_algorithm == kDigestAlgorithm) return OkStatus();
  if (m.digest_algorithm.empty()) {
    return FailedPrecondition(fmt::format(
        "manifest of version {}: field \"digest\" (content digest algorithm) is missing; this build computes and "
        "checks only \"{}\" (republish the version with this build)",
        m.version, kDigestAlgorithm));
  }
  return FailedPrecondition(
      fmt::format("manifest of version {}: field \"digest\" is \"{}\", but this build computes and checks only \"{}\"",
                  m.version, m.digest_algorithm, kDigestAlgorithm));
}

Result<TensorDigests> TensorDigestsFromShards(const Manifest& m) {
  RC_RETURN_IF_ERROR(CheckDigestAlgorithm(m));
  TensorDigests out;
  internal::ShardIndex index;
  for (const ShardTable& t : m.tables) {
    RC_RETURN_IF_ERROR(internal::IndexShards(t, &index));
    uint64_t sum = 0;
    for (const auto& u : index.boxes) {
      const ShardInfo& first = t.shards[index.order[u.first]];
      for (uint32_t k = u.first; k < u.first + u.count; ++k) {
        const ShardInfo& s = t.shards[index.order[k]];
        if (s.digest != first.digest) {
          return DataLoss(fmt::format("tensor {}: replicas on ranks {} and {} of box {} have digests {} and {}",
                                      t.name, first.rank, s.rank, BoxToString(u.box()), Hex64(first.digest),
                                      Hex64(s.digest)));
        }
      }
      sum += first.digest;
    }
    out[t.name] += sum;
  }
  return out;
}

std::vector<std::string> PublishedFp8Quantizations(const Manifest& m) {
  std::set<std::string> out;
  for (const ShardTable& t : m.tables) {
    for (const ShardInfo& s : t.shards) {
      for (const auto& [q, part] : s.fp8) out.insert(q);
    }
  }
  return {out.begin(), out.end()};
}

Result<Fp8Image> PublishedFp8Image(const Manifest& m, std::string_view quantization) {
  if (!IsFp8Quantization(quantization)) {
    return InvalidArgument(fmt::format("fp8 quantization '{}': expected one of fp8_per_tensor, fp8_per_channel, "
                                       "fp8_per_block",
                                       quantization));
  }
  Fp8Image out;
  std::vector<TensorSpec> specs;
  for (const ShardTable& t : m.tables) specs.push_back(t.spec());
  // Which tables carry the quantization at all: none -> the version has no published image for it.
  const ShardTable* carrier = nullptr;
  for (const ShardTable& t : m.tables) {
    for (const ShardInfo& s : t.shards) {
      if (s.fp8.count(quantization) && carrier == nullptr) carrier = &t;
    }
  }
  if (carrier == nullptr) return out;
  RC_ASSIGN_OR_RETURN(auto params, Fp8Parameters(specs));
  internal::ShardIndex index;
  for (const ShardTable& t : m.tables) {
    const auto of = Fp8ParameterOf(t.name);
    for (const ShardInfo& s : t.shards) {
      const bool has = s.fp8.count(quantization) > 0;
      if (has && !of) {
        return InvalidArgument(fmt::format("tensor {}: rank {} publishes an {} part, but the tensor is served in bf16 "
                                           "(only the projections are quantized)",
                                           t.name, s.rank, quantization));
      }
      if (!has && of) {
        return InvalidArgument(fmt::format("tensor {}: rank {}'s shard {} carries no {} part while tensor {} of rank {} "
                                           "does: every rank publishes the same FP8 parts",
                                           t.name, s.rank, BoxToString(s.box()), quantization, carrier->name,
                                           carrier->shards.front().rank));
      }
    }
    if (!of) continue;
    RC_RETURN_IF_ERROR(internal::IndexShards(t, &index));
    Fp8ImageDigest sum;
    for (const auto& u : index.boxes) {
      const ShardInfo& first = t.shards[index.order[u.first]];
      const Fp8ImageDigest& want = first.fp8.find(quantization)->second;
      for (uint32_t k = u.first; k < u.first + u.count; ++k) {
        const ShardInfo& s = t.shards[index.order[k]];
        const Fp8ImageDigest& got = s.fp8.find(quantization)->second;
        if (!(got == want)) {
          return DataLoss(fmt::format("tensor {}: replicas on ranks {} and {} of box {} publish different {} parts "
                                      "(bytes {} / {}, scales {} / {})",
                                      t.name, first.rank, s.rank, BoxToString(u.box()), quantization, Hex64(want.bytes),
                                      Hex64(got.bytes), Hex64(want.scales), Hex64(got.scales)));
        }
      }
      sum += want;
    }
    out[params.at(of->param).name] += sum;
  }
  return out;
}

// ---- JSON ---------------------------------------------------------------------------------------

namespace {

Json ShapeJson(const Shape& s) { return Json(s); }

Result<Shape> ShapeFromJson(const Json& obj, std::string_view key, const std::string& path) {
  auto it = obj.find(key);
  if (it == obj.end() || !it->is_array()) {
    return InvalidArgument(fmt::format("{}.{}: expected an array of integers", path, key));
  }
  Shape s;
  for (const auto& v : *it) {
    if (!v.is_number_integer()) return InvalidArgument(fmt::format("{}.{}: expected an array of integers", path, key));
    s.push_back(v.get<int64_t>());
  }
  return s;
}

Result<uint64_t> HexFromJson(const Json& obj, std::string_view key, const std::string& path) {
  RC_ASSIGN_OR_RETURN(std::string hex, GetString(obj, key, path, std::string(kZeroDigestHex)));
  return ContentDigest::ParseHex(hex, path.empty() ? std::string(key) : fmt::format("{}.{}", path, key));
}

}  // namespace

Json ManifestToJson(const Manifest& m) {
  Json tables = Json::array();
  for (const ShardTable& t : m.tables) {
    Json shards = Json::array();
    for (const ShardInfo& s : t.shards) {
      Json sj{{"rank", s.rank},
              {"offset", ShapeJson(s.offset)},
              {"shape", ShapeJson(s.shape)},
              {"handle", s.handle},
              {"digest", Hex64(s.digest)}};
      if (!s.fp8.empty()) {
        Json parts = Json::object();
        for (const auto& [q, part] : s.fp8) parts[q] = Json{{"bytes", Hex64(part.bytes)}, {"scales", Hex64(part.scales)}};
        sj["fp8"] = std::move(parts);
      }
      if (s.delta) {
        sj["delta"] = Json{{"base", s.delta->base},       {"base_digest", Hex64(s.delta->base_digest)},
                           {"handle", s.delta->handle},   {"offset", s.delta->offset},
                           {"bytes", s.delta->bytes},     {"changed", s.delta->changed}};
      }
      shards.push_back(std::move(sj));
    }
    tables.push_back({{"name", t.name}, {"dtype", DTypeName(t.dtype)}, {"shape", ShapeJson(t.shape)}, {"shards", shards}});
  }
  Json out{{"model", m.model},
           {"version", m.version},
           {"expected_ranks", m.expected_ranks},
           {"digest", m.digest_algorithm},
           {"content_digest", Hex64(m.content_digest)},
           {"tensors", tables}};
  if (!m.probes.empty()) out["probes"] = ProbesToJson(m.probes);
  return out;
}

Result<Manifest> ManifestFromJson(const Json& j) {
  RC_RETURN_IF_ERROR(
      CheckKnownKeys(j, {"model", "version", "expected_ranks", "digest", "content_digest", "tensors", "probes"}, ""));
  Manifest m;
  RC_ASSIGN_OR_RETURN(m.model, GetString(j, "model", "", std::string()));
  RC_ASSIGN_OR_RETURN(m.version, GetString(j, "version", "", std::string()));
  RC_ASSIGN_OR_RETURN(int64_t ranks, GetNonNegativeInt(j, "expected_ranks", "", 0));
  if (ranks > INT32_MAX) return InvalidArgument("expected_ranks: too large");
  m.expected_ranks = static_cast<int32_t>(ranks);
  RC_ASSIGN_OR_RETURN(m.content_digest, HexFromJson(j, "content_digest", ""));
  // Kept as read (empty when absent): TensorDigestsFromShards refuses what it cannot check.
  RC_ASSIGN_OR_RETURN(m.digest_algorithm, GetString(j, "digest", "", std::string()));
  if (auto pit = j.find("probes"); pit != j.end()) {
    RC_ASSIGN_OR_RETURN(m.probes, ProbesFromJson(*pit));
  }
  auto it = j.find("tensors");
  if (it == j.end() || !it->is_array()) return InvalidArgument("tensors: expected an array");
  for (size_t i = 0; i < it->size(); ++i) {
    const Json& tj = (*it)[i];
    const std::string path = fmt::format("tensors[{}]", i);
    RC_RETURN_IF_ERROR(CheckKnownKeys(tj, {"name", "dtype", "shape", "shards"}, path));
    ShardTable t;
    RC_ASSIGN_OR_RETURN(t.name, GetString(tj, "name", path));
    RC_ASSIGN_OR_RETURN(std::string dtype, GetString(tj, "dtype", path));
    auto d = ParseDType(dtype);
    if (!d.ok()) return d.status().WithContext(path + ".dtype");
    t.dtype = *d;
    RC_ASSIGN_OR_RETURN(t.shape, ShapeFromJson(tj, "shape", path));
    auto sit = tj.find("shards");
    if (sit == tj.end() || !sit->is_array()) return InvalidArgument(path + ".shards: expected an array");
    for (size_t k = 0; k < sit->size(); ++k) {
      const Json& sj = (*sit)[k];
      const std::string spath = fmt::format("{}.shards[{}]", path, k);
      RC_RETURN_IF_ERROR(CheckKnownKeys(sj, {"rank", "offset", "shape", "handle", "digest", "delta", "fp8"}, spath));
      ShardInfo s;
      RC_ASSIGN_OR_RETURN(int64_t rank, GetNonNegativeInt(sj, "rank", spath));
      if (rank > INT32_MAX) return InvalidArgument(spath + ".rank: too large");
      s.rank = static_cast<int32_t>(rank);
      RC_ASSIGN_OR_RETURN(s.offset, ShapeFromJson(sj, "offset", spath));
      RC_ASSIGN_OR_RETURN(s.shape, ShapeFromJson(sj, "shape", spath));
      RC_ASSIGN_OR_RETURN(s.handle, GetString(sj, "handle", spath, std::string()));
      RC_ASSIGN_OR_RETURN(s.digest, HexFromJson(sj, "digest", spath));
      if (auto fit = sj.find("fp8"); fit != sj.end()) {
        if (!fit->is_object()) return InvalidArgument(spath + ".fp8: expected an object of quantization -> part");
        for (auto it2 = fit->begin(); it2 != fit->end(); ++it2) {
          const std::string fpath = spath + ".fp8." + it2.key();
          if (!IsFp8Quantization(it2.key())) {
            return InvalidArgument(fmt::format("{}: '{}' is not an FP8 quantization (fp8_per_tensor, fp8_per_channel, "
                                               "fp8_per_block)",
                                               spath + ".fp8", it2.key()));
          }
          if (!it2->is_object()) return InvalidArgument(fpath + ": expected {\"bytes\": hex, \"scales\": hex}");
          RC_RETURN_IF_ERROR(CheckKnownKeys(*it2, {"bytes", "scales"}, fpath));
          if (!it2->contains("bytes") || !it2->contains("scales")) {
            return InvalidArgument(fpath + ": both \"bytes\" and \"scales\" are required");
          }
          Fp8ImageDigest part;
          RC_ASSIGN_OR_RETURN(part.bytes, HexFromJson(*it2, "bytes", fpath));
          RC_ASSIGN_OR_RETURN(part.scales, HexFromJson(*it2, "scales", fpath));
          s.fp8[it2.key()] = part;
        }
      }
      if (auto dit = sj.find("delta"); dit != sj.end() && !dit->is_null()) {
        const std::string dpath = spath + ".delta";
        RC_RETURN_IF_ERROR(CheckKnownKeys(*dit, {"base", "base_digest", "handle", "offset", "bytes", "changed"}, dpath));
        ShardDelta sd;
        RC_ASSIGN_OR_RETURN(sd.base, GetString(*dit, "base", dpath));
        RC_ASSIGN_OR_RETURN(sd.base_digest, HexFromJson(*dit, "base_digest", dpath));
        RC_ASSIGN_OR_RETURN(sd.handle, GetString(*dit, "handle", dpath));
        RC_ASSIGN_OR_RETURN(int64_t off, GetNonNegativeInt(*dit, "offset", dpath));
        RC_ASSIGN_OR_RETURN(int64_t len, GetNonNegativeInt(*dit, "bytes", dpath));
        RC_ASSIGN_OR_RETURN(sd.changed, GetNonNegativeInt(*dit, "changed", dpath));
        if (sd.base.empty() || sd.handle.empty()) return InvalidArgument(dpath + ": base and handle must not be empty");
        sd.offset = static_cast<uint64_t>(off);
        sd.bytes = static_cast<uint64_t>(len);
        s.delta = std::move(sd);
      }
      t.shards.push_back(std::move(s));
    }
    RC_RETURN_IF_ERROR(ValidateShardTable(t, /*require_complete=*/false));
    m.tables.push_back(std::move(t));
  }
  return m;
}

// The transport a shard handle belongs to: its descriptor's prefix ("shm:v1:..." → "shm").
Result<std::string> ManifestTransport(const Manifest& m) {
  std::string name;
  for (const auto& t : m.tables) {
    for (const auto& s : t.shards) {
      auto colon = s.handle.find(':');
      if (colon == std::string::npos) {
        return InvalidArgument("tensor " + t.name + ": shard of rank " + std::to_string(s.rank) +
                               " has a handle without a transport prefix");
      }
      std::string n = s.handle.substr(0, colon);
      if (name.empty()) name = n;
      if (n != name) {
        return InvalidArgument(fmt::format("version {} mixes transports ({} and {}); one transport per version is supported",
                                           m.version, name, n));
      }
    }
  }
  if (name.empty()) return InvalidArgument("version " + m.version + " has no shards");
  return name;
}

// Identifies the source topology: tensors, boxes and handles of every shard.
uint64_t SourceTopologyDigest(const Manifest& m) {
  Hasher h;
  for (const auto& t : m.tables) {
    h.Update(t.name).UpdateU64(static_cast<uint64_t>(t.dtype));
    for (int64_t d : t.shape) h.UpdateU64(static_cast<uint64_t>(d));
    for (const auto& s : t.shards) {
      h.UpdateU64(static_cast<uint64_t>(s.rank)).Update(s.handle);
      for (int64_t d : s.offset) h.UpdateU64(static_cast<uint64_t>(d));
      for (int64_t d : s.shape) h.UpdateU64(static_cast<uint64_t>(d));
    }
  }
  return h.Digest();
}

// First tensor whose digest differs, for messages.
std::string FirstDigestMismatch(const TensorDigests& got, const TensorDigests& want) {
  for (const auto& [name, v] : want) {
    auto it = got.find(name);
    if (it == got.end()) return "tensor " + name + " was not installed";
    if (it->second != v) return "tensor " + name + ": digest " + Hex64(it->second) + " != published " + Hex64(v);
  }
  for (const auto& [name, v] : got) {
    if (!want.count(name)) return "tensor " + name + " is not in the manifest";
  }
  return "";
}

}  // namespace rc::refit
