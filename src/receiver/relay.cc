#include "receiver/relay.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <unordered_map>

#include "rolloutcore/base/hash.h"
#include "rolloutcore/refit/digest.h"
#include "rolloutcore/receiver/source_imports.h"

namespace rc::receiver {

std::string RelayModelName(std::string_view model) { return std::string(model) + "@relay"; }
std::string RelayLabel(std::string_view version, std::string_view holder) {
  return std::string(version) + "@" + std::string(holder);
}
std::string RelayHolderOf(std::string_view label, std::string_view version) {
  if (label.size() <= version.size() + 1 || label.substr(0, version.size()) != version ||
      label[version.size()] != '@') {
    return "";
  }
  return std::string(label.substr(version.size() + 1));
}

RelayHolding::~RelayHolding() {
  if (!transport) return;
  for (uint64_t id : registrations) (void)transport->Deregister(id);
}

namespace {

struct HeldBox {
  refit::Box box;
  uint64_t digest = 0;
  uint64_t offset = 0;  // in the shm buffer
  uint64_t bytes = 0;
};

// Distinct boxes of a table, in order of first appearance, with the first replica's digest.
std::vector<HeldBox> DistinctBoxes(const refit::ShardTable& t) {
  std::vector<HeldBox> out;
  std::map<refit::Box, size_t> seen;
  for (const refit::ShardInfo& s : t.shards) {
    refit::Box b = s.box();
    if (b.numel() == 0 || seen.count(b)) continue;
    seen.emplace(b, out.size());
    out.push_back(HeldBox{std::move(b), s.digest, 0,
                          static_cast<uint64_t>(refit::NumElements(s.shape)) * refit::DTypeSize(t.dtype)});
  }
  return out;
}

}  // namespace

Result<std::unique_ptr<RelayHolding>> BuildRelayHolding(const refit::Manifest& manifest,
                                                        const std::vector<refit::Capture>& captures,
                                                        const std::vector<refit::DestinationBuffers>& buffers,
                                                        std::string model, std::string holder) {
  if (captures.size() != buffers.size()) return Internal("relay: captures and buffers differ in rank count");
  auto h = std::make_unique<RelayHolding>();
  h->model = std::move(model);
  h->version = manifest.version;
  h->holder = std::move(holder);
  std::unordered_map<std::string_view, size_t> table_of;
  std::vector<std::vector<HeldBox>> held(manifest.tables.size());
  uint64_t total = 0;
  for (size_t i = 0; i < manifest.tables.size(); ++i) {
    table_of.emplace(manifest.tables[i].name, i);
    held[i] = DistinctBoxes(manifest.tables[i]);
    for (HeldBox& b : held[i]) {
      b.offset = total;
      total += (b.bytes + 63) / 64 * 64;
    }
  }
  if (total == 0) return FailedPrecondition("relay of " + manifest.version + ": the manifest has no bytes");
  RC_ASSIGN_OR_RETURN(h->buffer, transport::ShmBuffer::Create(total));
  std::byte* base = h->buffer.data();

  // Read every copy back through its view into the boxes it overlaps.
  for (size_t r = 0; r < captures.size(); ++r) {
    const refit::Capture& cap = captures[r];
    for (const refit::CapturedCopy& c : cap.copies) {
      auto tit = table_of.find(c.source);
      if (tit == table_of.end()) continue;  // a source the manifest does not carry: nothing to serve
      const refit::ShardTable& t = manifest.tables[tit->second];
      const refit::TensorSpec& param = cap.params[c.param];
      auto pit = buffers[r].find(param.name);
      if (pit == buffers[r].end()) return Internal("relay: no buffer for parameter " + param.name);
      if (!refit::IsConversionSupported(param.dtype, t.dtype)) {
        return FailedPrecondition(
            fmt::format("relay of {}: tensor {} is held as {} and published as {}: the "
                        "published bits cannot be restored",
                        manifest.version, t.name, refit::DTypeName(param.dtype), refit::DTypeName(t.dtype)));
      }
      const size_t n = c.box.ndim();
      refit::Shape ds(n, 0);
      for (size_t k = 0; k < c.view_to_source.size(); ++k) {
        if (c.view_to_source[k] >= 0) ds[static_cast<size_t>(c.view_to_source[k])] = c.dest_strides[k];
      }
      const std::byte* pbase = pit->second.data();
      const size_t psize = refit::DTypeSize(param.dtype), ssize = refit::DTypeSize(t.dtype);
      for (const HeldBox& hb : held[tit->second]) {
        refit::Box sub;
        if (n == 0) {
          refit::ConvertElements(param.dtype, pbase + static_cast<size_t>(c.dest_offset) * psize, 1, t.dtype,
                                 base + hb.offset, 1, 1);
          continue;
        }
        if (!refit::Intersect(c.box, hb.box, &sub)) continue;
        const refit::Shape bs = refit::RowMajorStrides(hb.box.extent);
        std::vector<int64_t> idx(sub.start);  // global index of the current run's first element
        const int64_t inner = sub.extent[n - 1];
        for (;;) {
          int64_t src = c.dest_offset, dst = 0;
          for (size_t d = 0; d < n; ++d) {
            src += (idx[d] - c.box.start[d]) * ds[d];
            dst += (idx[d] - hb.box.start[d]) * bs[d];
          }
          refit::ConvertElements(param.dtype, pbase + static_cast<size_t>(src) * psize, ds[n - 1], t.dtype,
                                 base + hb.offset + static_cast<size_t>(dst) * ssize, 1, inner);
          size_t d = n - 1;
          bool done = true;
          while (d-- > 0) {
            if (++idx[d] < sub.start[d] + sub.extent[d]) {
              done = false;
              break;
            }
            idx[d] = sub.start[d];
          }
          if (done) break;
        }
      }
    }
  }

  // Prove every box holds the published bytes, then register it.
  RC_ASSIGN_OR_RETURN(h->transport, CreateManifestTransport(manifest));
  h->tables.reserve(manifest.tables.size());
  for (size_t i = 0; i < manifest.tables.size(); ++i) {
    const refit::ShardTable& t = manifest.tables[i];
    refit::ShardTable out{t.name, t.dtype, t.shape, {}};
    for (const HeldBox& hb : held[i]) {
      const uint64_t got = refit::DigestBlock(t.dtype, t.shape, hb.box, base + hb.offset);
      if (got != hb.digest) {
        return DataLoss(
            fmt::format("relay of {}: tensor {} box {} rebuilt from this engine's weights has digest {}, "
                        "published {}; nothing is relayed",
                        manifest.version, t.name, refit::BoxToString(hb.box), Hex64(got), Hex64(hb.digest)));
      }
      RC_ASSIGN_OR_RETURN(transport::Registration reg,
                          h->transport->RegisterMemory(h->buffer.region(hb.offset, hb.bytes)));
      h->registrations.push_back(reg.id);
      out.shards.push_back(refit::ShardInfo{0, hb.box.start, hb.box.extent, reg.descriptor, hb.digest});
      h->bytes += hb.bytes;
    }
    h->tables.push_back(std::move(out));
  }
  return h;
}

Result<MergedSources> MergeRelayHolders(const refit::Manifest& origin, const std::vector<RelayRecord>& records,
                                        const std::set<std::string>& excluded) {
  MergedSources m;
  m.manifest = origin;
  int32_t first = origin.expected_ranks;
  for (const refit::ShardTable& t : origin.tables) {
    for (const refit::ShardInfo& s : t.shards) first = std::max(first, s.rank + 1);
  }
  m.first_relay_rank = first;
  // Usable holders in name order; per holder, its tables by name.
  // A record on another transport than V's would make the version mix transports: not used.
  auto origin_transport = refit::ManifestTransport(origin);
  std::vector<const RelayRecord*> usable;
  for (const RelayRecord& r : records) {
    if (excluded.count(r.holder) || !origin_transport.ok()) continue;
    auto t = refit::ManifestTransport(r.manifest);
    if (t.ok() && *t == *origin_transport) usable.push_back(&r);
  }
  std::sort(usable.begin(), usable.end(),
            [](const RelayRecord* a, const RelayRecord* b) { return a->holder < b->holder; });
  std::vector<std::unordered_map<std::string_view, const refit::ShardTable*>> tables(usable.size());
  for (size_t h = 0; h < usable.size(); ++h) {
    m.holders.push_back(usable[h]->holder);
    for (const refit::ShardTable& t : usable[h]->manifest.tables) tables[h].emplace(t.name, &t);
  }
  uint64_t box_counter = 0;
  for (refit::ShardTable& t : m.manifest.tables) {
    std::vector<refit::ShardInfo> merged;
    std::map<refit::Box, bool> done;
    for (const refit::ShardInfo& s : t.shards) {
      const refit::Box box = s.box();
      if (done.count(box)) continue;
      std::vector<refit::ShardInfo> relayed;
      for (size_t h = 0; h < usable.size(); ++h) {
        auto it = tables[h].find(t.name);
        if (it == tables[h].end() || it->second->dtype != t.dtype || it->second->shape != t.shape) continue;
        for (const refit::ShardInfo& rs : it->second->shards) {
          if (rs.offset == s.offset && rs.shape == s.shape && rs.digest == s.digest) {
            relayed.push_back(
                refit::ShardInfo{first + static_cast<int32_t>(h), s.offset, s.shape, rs.handle, s.digest});
            break;
          }
        }
      }
      done.emplace(box, true);
      if (relayed.empty()) {
        for (const refit::ShardInfo& o : t.shards) {
          if (o.offset == s.offset && o.shape == s.shape) merged.push_back(o);
        }
        ++m.boxes_from_origin;
      } else {
        // The planner picks replica (copy turn + dest_rank) mod holders in this order: starting
        // box j at holder j spreads one receiver's boxes over every holder, and receivers
        // (dest_rank) over them too.
        std::rotate(relayed.begin(), relayed.begin() + static_cast<std::ptrdiff_t>(box_counter % relayed.size()),
                    relayed.end());
        ++box_counter;
        merged.insert(merged.end(), relayed.begin(), relayed.end());
        ++m.boxes_relayed;
      }
    }
    t.shards = std::move(merged);
  }
  return m;
}

}  // namespace rc::receiver
