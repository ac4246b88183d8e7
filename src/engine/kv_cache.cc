#include "rolloutcore/engine/kv_cache.h"

#include <algorithm>

#include "rolloutcore/base/hash.h"

namespace rc::engine {

uint64_t KvBlockHash(uint64_t parent, std::span<const int32_t> tokens, std::string_view salt) {
  Hasher h(0x6b76626c6f636b31ULL);  // "kvblock1"
  h.UpdateU64(parent);
  h.UpdateU64(tokens.size());
  h.Update(tokens.data(), tokens.size_bytes());
  if (parent == 0) {
    h.UpdateU64(salt.size());
    h.Update(salt);
  }
  uint64_t v = h.Digest();
  return v == 0 ? 1 : v;  // 0 is reserved for "no parent"
}

KvCacheManager::KvCacheManager(int64_t num_blocks, int64_t block_size, bool enable_prefix_caching)
    : num_blocks_(num_blocks), block_size_(block_size), prefix_caching_(enable_prefix_caching) {
  blocks_.resize(static_cast<size_t>(num_blocks));
  free_.reserve(static_cast<size_t>(num_blocks));
  // Taken from the back: lowest ids first.
  for (int64_t i = num_blocks - 1; i >= 0; --i) free_.push_back(static_cast<int32_t>(i));
}

namespace {
bool Contains(const std::vector<int32_t>& v, int32_t x) { return std::find(v.begin(), v.end(), x) != v.end(); }
}  // namespace

bool KvCacheManager::PlanDemand(const KvDemand& d, KvPlan* plan) const {
  KvGrant g;
  g.seq_id = d.seq_id;
  std::vector<int32_t> newly_revived;
  if (d.match_prefix && prefix_caching_ && d.held_blocks == 0) {
    uint64_t parent = 0;
    const int64_t full = static_cast<int64_t>(d.prefix_tokens.size()) / block_size_;
    for (int64_t b = 0; b < full; ++b) {
      const uint64_t h = KvBlockHash(parent, d.prefix_tokens.subspan(static_cast<size_t>(b * block_size_),
                                                                       static_cast<size_t>(block_size_)),
                                     d.cache_salt);
      auto it = by_hash_.find(h);
      if (it == by_hash_.end() || Contains(plan->evicted, it->second)) break;
      const int32_t id = it->second;
      const bool unreferenced = blocks_[static_cast<size_t>(id)].ref == 0 || Contains(plan->released_evictable, id);
      if (unreferenced && !Contains(plan->revived, id) && !Contains(newly_revived, id)) {
        newly_revived.push_back(id);
      }
      g.hit_blocks.push_back(id);
      g.hit_hashes.push_back(h);
      parent = h;
    }
  }
  const int64_t total_blocks = (d.need_tokens + block_size_ - 1) / block_size_;
  int64_t need_new = total_blocks - d.held_blocks - static_cast<int64_t>(g.hit_blocks.size());
  if (need_new < 0) need_new = 0;
  // Candidates: free list first (from the back; blocks the plan releases are pushed onto its back
  // first), then evictable blocks oldest first (those the plan releases after the others).
  const auto rel_free = static_cast<int64_t>(plan->released_free.size());
  int64_t free_left = static_cast<int64_t>(free_.size()) + rel_free - plan->free_taken;
  int64_t from_free = std::min(free_left, need_new);
  std::vector<int32_t> evict;
  if (need_new > from_free) {
    auto consider = [&](int32_t id) {
      if (static_cast<int64_t>(evict.size()) == need_new - from_free) return false;
      if (Contains(plan->revived, id) || Contains(newly_revived, id) || Contains(plan->evicted, id)) return true;
      evict.push_back(id);
      return true;
    };
    bool more = true;
    for (auto it = evictable_.begin(); more && it != evictable_.end(); ++it) more = consider(*it);
    for (auto it = plan->released_evictable.begin(); more && it != plan->released_evictable.end(); ++it) {
      more = consider(*it);
    }
    if (static_cast<int64_t>(evict.size()) < need_new - from_free) return false;
  }
  for (int64_t i = 0; i < from_free; ++i) {
    const int64_t v = plan->free_taken + i;  // position from the back of the free list after the releases
    g.new_blocks.push_back(v < rel_free ? plan->released_free[static_cast<size_t>(rel_free - 1 - v)]
                                        : free_[free_.size() - 1 - static_cast<size_t>(v - rel_free)]);
  }
  plan->free_taken += from_free;
  for (int32_t id : evict) {
    g.new_blocks.push_back(id);
    plan->evicted.push_back(id);
  }
  for (int32_t id : newly_revived) plan->revived.push_back(id);
  plan->grants.push_back(std::move(g));
  return true;
}

void KvCacheManager::PlanRelease(std::span<const int32_t> blocks, KvPlan* plan) const {
  for (auto it = blocks.rbegin(); it != blocks.rend(); ++it) {
    const Block& b = blocks_[static_cast<size_t>(*it)];
    int32_t& dropped = plan->released_refs[*it];
    if (b.ref - dropped <= 0) continue;  // as Release: never underflow
    ++dropped;
    plan->released.push_back(*it);
    if (b.ref - dropped == 0) (b.hashed ? plan->released_evictable : plan->released_free).push_back(*it);
  }
}

void KvCacheManager::Apply(const KvPlan& plan) {
  for (int32_t id : plan.released) ReleaseOne(id);
  for (const KvGrant& g : plan.grants) {
    for (int32_t id : g.hit_blocks) {
      Block& b = blocks_[static_cast<size_t>(id)];
      if (b.ref == 0) {
        evictable_.erase(b.lru_it);
        ++in_use_;
      }
      ++b.ref;
    }
    for (int32_t id : g.new_blocks) {
      Block& b = blocks_[static_cast<size_t>(id)];
      if (b.hashed) {
        evictable_.erase(b.lru_it);
        by_hash_.erase(b.hash);
        b.hashed = false;
        b.hash = 0;
      } else {
        auto it = std::find(free_.rbegin(), free_.rend(), id);
        free_.erase(std::next(it).base());
      }
      b.ref = 1;
      ++in_use_;
    }
  }
}

void KvCacheManager::Release(std::span<const int32_t> blocks) {
  for (auto it = blocks.rbegin(); it != blocks.rend(); ++it) ReleaseOne(*it);
}

void KvCacheManager::ReleaseOne(int32_t id) {
  Block& b = blocks_[static_cast<size_t>(id)];
  if (b.ref <= 0) return;  // defensive: never underflow
  if (--b.ref == 0) {
    --in_use_;
    if (b.hashed) {
      b.lru_it = evictable_.insert(evictable_.end(), id);
    } else {
      free_.push_back(id);
    }
  }
}

void KvCacheManager::RegisterFullBlocks(std::span<const int32_t> blocks, std::span<const uint64_t> hashes,
                                        size_t first) {
  if (!prefix_caching_) return;
  for (size_t i = first; i < hashes.size() && i < blocks.size(); ++i) {
    Block& b = blocks_[static_cast<size_t>(blocks[i])];
    if (b.hashed || by_hash_.count(hashes[i]) != 0) continue;
    b.hashed = true;
    b.hash = hashes[i];
    by_hash_.emplace(hashes[i], blocks[i]);
  }
}

KvResetEvidence KvCacheManager::ResetPrefixCache(int64_t unhashed_borrowed) {
  KvResetEvidence ev;
  ev.blocks_in_use = in_use_;
  if (in_use_ - unhashed_borrowed > 0) return ev;
  ev.freed_blocks = static_cast<int64_t>(by_hash_.size());
  for (int32_t id : evictable_) {
    Block& b = blocks_[static_cast<size_t>(id)];
    b.hashed = false;
    b.hash = 0;
    free_.push_back(id);
  }
  evictable_.clear();
  by_hash_.clear();
  std::sort(free_.begin(), free_.end(), std::greater<int32_t>());
  ev.success = true;
  return ev;
}

KvResetEvidence KvCacheManager::ForgetAllHashes() {
  KvResetEvidence ev;
  ev.blocks_in_use = in_use_;
  ev.freed_blocks = static_cast<int64_t>(by_hash_.size());
  for (auto& [hash, id] : by_hash_) {
    Block& b = blocks_[static_cast<size_t>(id)];
    b.hashed = false;
    b.hash = 0;
    if (b.ref == 0) free_.push_back(id);
  }
  evictable_.clear();
  by_hash_.clear();
  std::sort(free_.begin(), free_.end(), std::greater<int32_t>());
  ev.success = true;
  return ev;
}

}  // namespace rc::engine
