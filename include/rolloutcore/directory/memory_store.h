// MemoryStore: a DirectoryStore held in this process's memory (tests, an in-process directory,
// `rolloutcore directory serve --store memory`). Nothing survives the process.
//
// Leases are timed by the injected Clock (a ManualClock in tests, so expiry needs no sleeping);
// expiry is applied lazily at the start of every call, before anything else is looked at, so an
// expired lease is always observed before a publish could commit its version.
//
// Thread safety: all methods may be called from any thread; one mutex serializes them, which is
// what makes commit atomic. WaitForCommits waits on a condition variable without the mutex held.
#pragma once

#include <memory>

#include "rolloutcore/base/clock.h"
#include "rolloutcore/directory/store.h"

namespace rc::directory {

// `clock` must outlive the store.
std::unique_ptr<DirectoryStore> NewMemoryStore(Clock* clock);

}  // namespace rc::directory
