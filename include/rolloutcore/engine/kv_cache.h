// KvCacheManager: the paged KV block pool with prefix caching.
//
// Blocks hold block_size token positions. A full block can be registered under a chained hash
// hash(parent block hash, its token ids, extra keys) where the first block's extra keys carry
// the request's cache_salt, so equal prefixes with different salts never share KV. Blocks are
// reference counted; a block whose count drops to zero keeps its hash and joins an LRU list of
// evictable cached blocks, from which a later request can revive it (a cache hit) or an
// allocation can evict it (oldest first) when no never-cached block is free.
//
// Plan, then apply: Plan* methods are const and describe what a step would take (cache hits,
// new blocks, evictions); only Apply, Release, RegisterFullBlocks and Reset* mutate. That
// gives refit exactly one place to invalidate KV computed under old weights (ResetPrefixCache /
// ResetAll), and lets the scheduler try admissions without side effects.
//
// Invariants: every block is in exactly one of {in use (ref > 0), evictable (ref 0, hashed),
// free (ref 0, unhashed)}; the hash map holds only hashed blocks, one block per hash.
// Thread safety: not synchronized; the engine calls it under its own mutex.
#pragma once

#include <cstdint>
#include <list>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "rolloutcore/base/status.h"

namespace rc::engine {

// Chained block hash; parent 0 means "no parent" (first block), which then mixes in salt.
uint64_t KvBlockHash(uint64_t parent, std::span<const int32_t> tokens, std::string_view salt);

struct KvDemand {
  int64_t seq_id = 0;
  // For an admission: the tokens whose full blocks may come from the cache, and the salt.
  bool match_prefix = false;
  std::span<const int32_t> prefix_tokens;
  std::string_view cache_salt;
  int64_t held_blocks = 0;  // blocks the sequence already holds
  int64_t need_tokens = 0;  // positions it must hold after the step
};

struct KvGrant {
  int64_t seq_id = 0;
  std::vector<int32_t> hit_blocks;    // cached blocks reused (in prefix order)
  std::vector<uint64_t> hit_hashes;   // their chained hashes
  std::vector<int32_t> new_blocks;    // fresh blocks (possibly evicted cached ones)
};

struct KvPlan {
  std::vector<KvGrant> grants;
  // Bookkeeping against the snapshot the plan was made on.
  int64_t free_taken = 0;          // blocks taken from the back of the free list
  std::vector<int32_t> revived;    // evictable blocks reused as cache hits
  std::vector<int32_t> evicted;    // evictable blocks taken as new blocks
  // Releases planned before the grants (PlanRelease), in the order Apply performs them, and the
  // blocks they leave unreferenced: unhashed ones join the back of the free list, hashed ones the
  // tail of the LRU list (as Release would put them). References dropped per block.
  std::vector<int32_t> released;
  std::vector<int32_t> released_free;
  std::vector<int32_t> released_evictable;
  std::unordered_map<int32_t, int32_t> released_refs;
};

struct KvResetEvidence {
  bool success = false;
  int64_t freed_blocks = 0;   // cached blocks whose hash was dropped
  int64_t blocks_in_use = 0;  // blocks with ref > 0 at the time of the call
};

class KvCacheManager {
 public:
  KvCacheManager(int64_t num_blocks, int64_t block_size, bool enable_prefix_caching);

  int64_t num_blocks() const { return num_blocks_; }
  int64_t block_size() const { return block_size_; }
  bool prefix_caching() const { return prefix_caching_; }
  int64_t BlocksInUse() const { return in_use_; }
  int64_t NumCachedBlocks() const { return static_cast<int64_t>(by_hash_.size()); }
  int64_t NumFreeBlocks() const { return num_blocks_ - in_use_; }

  // Adds a grant for `d` to the plan, or returns false (plan unchanged) when the pool cannot
  // satisfy it on top of what the plan already took.
  bool PlanDemand(const KvDemand& d, KvPlan* plan) const;
  // Adds the release of `blocks` (as Release(blocks) would do it: tail first) to the plan;
  // demands planned afterwards can take the blocks it leaves unreferenced. Releases must be
  // planned before any demand of the same plan (Apply releases first).
  void PlanRelease(std::span<const int32_t> blocks, KvPlan* plan) const;
  // Commits a plan made against the current state (no mutation in between): its releases, then
  // its grants.
  void Apply(const KvPlan& plan);

  // Drops one reference to each block (tail first, so a prefix outlives its tail in the LRU).
  void Release(std::span<const int32_t> blocks);
  // Registers blocks[i] under hashes[i] for i in [first, hashes.size()) when the hash is new.
  void RegisterFullBlocks(std::span<const int32_t> blocks, std::span<const uint64_t> hashes, size_t first);

  // Drops all cached hashes; refuses (success=false, nothing changed) while any block is in use,
  // except `unhashed_borrowed` blocks the caller holds outside any request and never registers
  // (a pre-replay's borrowed KV: no hash of theirs exists, so dropping every hash is complete).
  KvResetEvidence ResetPrefixCache(int64_t unhashed_borrowed = 0);
  // Free blocks that hold no cached prefix (taking them evicts nothing).
  int64_t NumUnhashedFreeBlocks() const { return static_cast<int64_t>(free_.size()); }
  // Drops every hash, those of blocks in use included (their holders keep them; released, they
  // become free, not evictable): afterwards no lookup can hit any block that exists now. Used
  // when requests keep their (stale) KV across a weight swap. Always succeeds.
  KvResetEvidence ForgetAllHashes();

 private:
  struct Block {
    int32_t ref = 0;
    bool hashed = false;
    uint64_t hash = 0;
    std::list<int32_t>::iterator lru_it;
  };

  void ReleaseOne(int32_t id);

  int64_t num_blocks_;
  int64_t block_size_;
  bool prefix_caching_;
  std::vector<Block> blocks_;
  std::vector<int32_t> free_;         // ref 0, unhashed; taken from the back
  std::list<int32_t> evictable_;      // ref 0, hashed; front = least recently released
  std::unordered_map<uint64_t, int32_t> by_hash_;
  int64_t in_use_ = 0;
};

}  // namespace rc::engine
