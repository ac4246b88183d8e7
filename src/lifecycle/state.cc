#include "rolloutcore/lifecycle/state.h"

#include <array>

namespace rc::lifecycle {
namespace {

constexpr std::array<std::string_view, kNumStates> kStateNames = {
    "UNINITIALIZED", "READY",      "DRAINING", "QUIESCED", "UPDATING",
    "INVALIDATING",  "VALIDATING", "RESUMING", "TAINTED",  "RECOVERING"};

constexpr std::array<std::string_view, kNumEvents> kEventNames = {
    "initialize",      "request_update", "drain_complete",         "begin_install",
    "install_complete", "caches_reset",  "validated",              "resumed",
    "reject_before_mutation", "taint",   "begin_recovery",         "recovered"};

struct Edge {
  State from;
  Event event;
  State to;
};

// The one table. Everything not listed is illegal.
constexpr Edge kEdges[] = {
    {State::kUninitialized, Event::kInitialize, State::kReady},
    {State::kReady, Event::kRequestUpdate, State::kDraining},
    {State::kDraining, Event::kDrainComplete, State::kQuiesced},
    {State::kQuiesced, Event::kBeginInstall, State::kUpdating},
    {State::kUpdating, Event::kInstallComplete, State::kInvalidating},
    {State::kInvalidating, Event::kCachesReset, State::kValidating},
    {State::kValidating, Event::kValidated, State::kResuming},
    {State::kResuming, Event::kResumed, State::kReady},
    {State::kDraining, Event::kRejectBeforeMutation, State::kReady},
    {State::kQuiesced, Event::kRejectBeforeMutation, State::kReady},
    {State::kUpdating, Event::kRejectBeforeMutation, State::kReady},
    // READY → TAINTED: the engine is not what was verified (it restarted, its label or weights
    // changed behind the controller, or a restarted controller's journal claims another state).
    {State::kReady, Event::kTaint, State::kTainted},
    {State::kUpdating, Event::kTaint, State::kTainted},
    {State::kInvalidating, Event::kTaint, State::kTainted},
    {State::kValidating, Event::kTaint, State::kTainted},
    {State::kResuming, Event::kTaint, State::kTainted},
    {State::kRecovering, Event::kTaint, State::kTainted},
    {State::kTainted, Event::kBeginRecovery, State::kRecovering},
    {State::kRecovering, Event::kRecovered, State::kReady},
};

}  // namespace

std::string_view StateName(State s) {
  auto i = static_cast<size_t>(s);
  return i < kStateNames.size() ? kStateNames[i] : "UNKNOWN";
}

std::string_view EventName(Event e) {
  auto i = static_cast<size_t>(e);
  return i < kEventNames.size() ? kEventNames[i] : "unknown";
}

std::optional<State> StateFromName(std::string_view name) {
  for (size_t i = 0; i < kStateNames.size(); ++i) {
    if (kStateNames[i] == name) return static_cast<State>(i);
  }
  return std::nullopt;
}

std::optional<Event> EventFromName(std::string_view name) {
  for (size_t i = 0; i < kEventNames.size(); ++i) {
    if (kEventNames[i] == name) return static_cast<Event>(i);
  }
  return std::nullopt;
}

std::optional<State> NextState(State from, Event event) {
  for (const Edge& e : kEdges) {
    if (e.from == from && e.event == event) return e.to;
  }
  return std::nullopt;
}

bool MutationMayHaveBegun(State s) {
  return s == State::kUpdating || s == State::kInvalidating || s == State::kValidating ||
         s == State::kResuming || s == State::kRecovering || s == State::kTainted;
}

bool EngineMayBePaused(State s) {
  // DRAINING too: a strict drain ends with the pause, before QUIESCED is journaled.
  return s == State::kDraining || s == State::kQuiesced || s == State::kUpdating || s == State::kInvalidating ||
         s == State::kValidating || s == State::kResuming || s == State::kRecovering ||
         s == State::kTainted;
}

}  // namespace rc::lifecycle
