// The lifecycle states and events of one engine, and the one legal-transition table.
//
//   UNINITIALIZED → READY → DRAINING → QUIESCED → UPDATING → INVALIDATING → VALIDATING
//                     ▲                                                        │
//                     └──────────────────────── RESUMING ◄─────────────────────┘
//   plus TAINTED (ambiguous after mutation began, or a READY engine that is not what was
//   verified: restarted, changed behind the controller's back) and RECOVERING (TAINTED →
//   verified full re-install → READY).
//
// Admission happens only in READY. Weights may change only in UPDATING and RECOVERING; the
// engine is paused from QUIESCED until RESUMING completes.
//
// Thread safety: pure functions and constants.
#pragma once

#include <optional>
#include <string_view>

namespace rc::lifecycle {

enum class State {
  kUninitialized,
  kReady,
  kDraining,
  kQuiesced,
  kUpdating,
  kInvalidating,
  kValidating,
  kResuming,
  kTainted,
  kRecovering,
};
inline constexpr int kNumStates = 10;

enum class Event {
  kInitialize,            // UNINITIALIZED → READY: the version the engine started with
  kRequestUpdate,         // READY → DRAINING: admissions refused (retryable) from now on
  kDrainComplete,         // DRAINING → QUIESCED: engine idle AND no active binding
  kBeginInstall,          // QUIESCED → UPDATING: engine confirmed paused and idle
  kInstallComplete,       // UPDATING → INVALIDATING: install evidence for the target
  kCachesReset,           // INVALIDATING → VALIDATING: every cache reset confirmed
  kValidated,             // VALIDATING → RESUMING: label (and digest) equal the target
  kResumed,               // RESUMING → READY on the target version (the commit)
  kRejectBeforeMutation,  // DRAINING | QUIESCED | UPDATING → READY on the old version
  kTaint,                 // READY | UPDATING..RESUMING | RECOVERING → TAINTED
  kBeginRecovery,         // TAINTED → RECOVERING
  kRecovered,             // RECOVERING → READY on the re-installed, digest-verified version
};
inline constexpr int kNumEvents = 12;

std::string_view StateName(State s);    // "READY", "DRAINING", ...
std::string_view EventName(Event e);    // "request_update", ...
std::optional<State> StateFromName(std::string_view name);
std::optional<Event> EventFromName(std::string_view name);

// The legal-transition table: the next state, or nullopt when the event is illegal in `from`.
std::optional<State> NextState(State from, Event event);

// True in states where live weights may differ from the committed version (a restart in one
// of these without a commit record comes back TAINTED).
bool MutationMayHaveBegun(State s);
// True in states where the engine is (or may be) paused by the controller.
bool EngineMayBePaused(State s);

}  // namespace rc::lifecycle
