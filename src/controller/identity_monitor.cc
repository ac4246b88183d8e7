// The engine-identity monitor of the controller service (identity_monitor.h).
#include "controller/identity_monitor.h"

#include <algorithm>

#include "rolloutcore/base/clock.h"
#include "rolloutcore/base/log.h"
#include "rolloutcore/base/mutex.h"

namespace rc::controller {

using lifecycle::State;

Status IdentityMonitor::InitEngine(EngineSlot* slot, bool must_exist) {
  auto path = core_->options.state_dir + "/engine-" + std::to_string(slot->index) + ".journal.db";
  RC_ASSIGN_OR_RETURN(auto journal, lifecycle::SqliteJournal::Open(path, must_exist));
  slot->journal = std::move(journal);
  lifecycle::RestoreSummary summary;
  RC_ASSIGN_OR_RETURN(slot->controller,
                      lifecycle::Controller::Open(SystemClock::Default(), slot->journal.get(), &summary));
  slot->runner = std::make_unique<lifecycle::Runner>(slot->controller.get(), slot->handle.adapter.get(),
                                                     SystemClock::Default(), core_->options.runner);
  if (slot->controller->state() == State::kUninitialized) {
    // A fresh journal: the engine serves whatever it loaded; record that as generation 0.
    RC_ASSIGN_OR_RETURN(auto desc, slot->handle.adapter->Describe());
    RC_ASSIGN_OR_RETURN(auto label, AwaitPending(slot->handle.adapter->ReadLabel(), 10000, "reading the label"));
    lifecycle::WeightIdentity identity;
    if (desc.offers_content_digest) {
      RC_ASSIGN_OR_RETURN(auto digest,
                          AwaitPending(slot->handle.adapter->ReadContentDigest(), 60000, "reading the digest"));
      identity.content_digest = digest.content_digest;
      if (digest.quantized && !digest.quantized->Match()) {
        // The engine quantized what it loaded itself (FP8 serving, docs/fp8.md) into an image that
        // is not the quantization of those weights: nothing it computes is what the digest names.
        return FailedPrecondition("engine " + slot->handle.name + ": " +
                                  digest.quantized->Mismatch("the weights it loaded"));
      }
    }
    identity.checkpoint = "initial";
    RC_RETURN_IF_ERROR(slot->controller->Initialize({label.label, 0}, identity));
  } else {
    RC_LOG_WARN("engine {}: restored from {} in {} (was {} when the previous controller stopped; {} rollouts "
                "recorded interrupted)",
                slot->handle.name, path, lifecycle::StateName(summary.state_now),
                lifecycle::StateName(summary.state_at_crash), summary.interrupted.size());
    if (summary.state_now == State::kReady && summary.engine_may_be_paused) {
      // Resumed and answered before the check below, which taints an engine still paused.
      auto resumed = AwaitPending(slot->handle.adapter->Resume(),
                                  std::max<int64_t>(core_->options.runner.deadlines.resume_ms, 1),
                                  "resuming " + slot->handle.name + " (it may have been paused at the crash)");
      if (!resumed.ok() || resumed->paused_after) {
        RC_LOG_WARN("engine {}: the resume after the restart {}", slot->handle.name,
                    resumed.ok() ? std::string("left it paused") : resumed.status().ToString());
      }
    }
  }
  // Nothing is admitted before the engine was checked against what the journal claims (label and
  // content digest); an engine unreachable now stays unverified (no admissions) and is retried.
  VerifyIdentity(slot, /*after_op=*/false, /*claim=*/true);
  return OkStatus();
}

bool IdentityMonitor::IdentityVerified(const EngineSlot* slot) const {
  rc::MutexLock lock(slot->id_mu);
  return slot->id.verified;
}

void IdentityMonitor::VerifyIdentity(EngineSlot* slot, bool after_op, bool claim) {
  if (slot->controller->state() != State::kReady) {
    // TAINTED admits nothing (a recovery re-verifies); other states belong to an operation.
    if (after_op) {
      slot->after_op_pending = false;
      slot->settling = false;  // not READY: the state itself admits nothing
    }
    return;
  }
  lifecycle::EngineAdapter* adapter = slot->handle.adapter.get();
  const int64_t timeout = std::max<int64_t>(core_->options.runner.deadlines.poll_ms, 1);
  auto fail = [&](const Status& st) {
    RC_LOG_WARN("engine {}: identity probe failed: {}", slot->handle.name, st.ToString());
    rc::MutexLock lock(slot->id_mu);
    slot->id.last_error = st.ToString();
  };
  lifecycle::IdentityEvidence e;
  auto probe = AwaitPending(adapter->ProbeIdentity(), timeout, "identity probe of " + slot->handle.name);
  if (probe.ok()) {
    e = *probe;
  } else if (probe.status().code() == StatusCode::kUnimplemented) {
    // The engine cannot report boot id or install generation: its label is what can be checked.
    auto label = AwaitPending(adapter->ReadLabel(), timeout, "reading the label of " + slot->handle.name);
    if (!label.ok()) return fail(label.status());
    e.label = label->label;
  } else {
    return fail(probe.status());
  }
  const lifecycle::WeightVersion committed = slot->controller->version();
  const lifecycle::WeightIdentity committed_id = slot->controller->identity();
  std::string quantized_why;
  if (claim && e.content_digest.empty() && !committed_id.content_digest.empty()) {
    // A (re)started controller proves the digest too, computing it when none is cached.
    auto desc = adapter->Describe();
    if (!desc.ok()) return fail(desc.status());
    if (desc->offers_content_digest) {
      auto d = AwaitPending(adapter->ReadContentDigest(), std::max<int64_t>(core_->options.runner.deadlines.validate_ms, 1),
                            "reading the content digest of " + slot->handle.name);
      if (!d.ok()) return fail(d.status());
      e.content_digest = d->content_digest;
      if (d->quantized && !d->quantized->Match()) {
        // FP8 serving (docs/fp8.md): the weights may be the committed ones while what the kernels
        // read is not their quantization.
        quantized_why = d->quantized->Mismatch("its live weights");
      }
    }
  }
  std::vector<std::string> why;
  if (!quantized_why.empty()) why.push_back(quantized_why);
  // Paused while READY (a pause behind the controller's back, or one that landed after its update
  // was given up): every rollout admitted would hang. Only while still READY (TaintIfReady below):
  // an update that began meanwhile pauses the engine itself.
  const bool paused = e.paused.value_or(false);
  if (paused) why.push_back("the engine reports itself paused while READY: every rollout admitted to it would hang");
  if (e.label != committed.label) {
    why.push_back("the engine reports label '" + e.label + "', the committed version is '" + committed.label + "'");
  }
  if (!e.content_digest.empty() && !committed_id.content_digest.empty() &&
      e.content_digest != committed_id.content_digest) {
    why.push_back("live content digest " + e.content_digest + " != committed digest " + committed_id.content_digest);
  }
  {
    rc::MutexLock lock(slot->id_mu);
    VerifiedIdentity& v = slot->id;
    const bool committed_op = after_op && committed.generation > slot->generation_before_op;
    const bool committed_recovery = committed_op && slot->running_recovery;
    const bool restarted = v.verified && !v.boot_id.empty() && e.boot_id != v.boot_id;
    if (restarted && !committed_recovery) {
      why.push_back("the engine restarted (boot id " + v.boot_id + " -> " + (e.boot_id.empty() ? "none" : e.boot_id) +
                    "): what this controller installed and verified is gone");
    }
    if (!restarted && v.verified && v.install_generation >= 0 && e.install_generation != v.install_generation &&
        !committed_op && (v.generation_settled || after_op)) {
      why.push_back("the engine's install generation moved " + std::to_string(v.install_generation) + " -> " +
                    std::to_string(e.install_generation) + " with no update by this controller: weights were "
                    "installed behind its back");
    }
    if (!v.suspect.empty() && !committed_op) why.push_back(v.suspect);
    v.suspect.clear();
    ++v.checks;
    v.checked_wall_ms = WallTimeMs();
    v.last_error.clear();
    if (why.empty()) {
      v.verified = true;
      v.boot_id = e.boot_id;
      v.install_generation = e.install_generation;
      v.generation_settled = true;
    } else {
      ++v.mismatches;
    }
  }
  if (after_op) slot->after_op_pending = false;
  if (why.empty()) {
    if (after_op) slot->settling = false;
    return;
  }
  std::string reason = claim ? "controller start: the journal claims label '" + committed.label + "' (digest " +
                                   (committed_id.content_digest.empty() ? "unknown" : committed_id.content_digest) +
                                   ") but " + Join(why)
                             : "identity check: " + Join(why);
  TaintForIdentity(slot, reason, /*ready_only=*/true, /*only_paused=*/paused && why.size() == 1);
  if (after_op) slot->settling = false;
}

void IdentityMonitor::TaintForIdentity(EngineSlot* slot, const std::string& reason, bool ready_only,
                                       bool only_paused) {
  // A check of a READY engine taints only from READY: an update that began since the probe (and
  // paused the engine, or changes its label) is not what the probe saw.
  Status s = ready_only ? slot->controller->TaintIfReady(reason) : slot->controller->Taint(reason);
  if (!s.ok()) {
    // Not READY (an update runs, or already TAINTED): the check after the operation decides. A
    // pause is not kept as a suspicion: the update that began paused the engine itself.
    RC_LOG_WARN("engine {}: {} (not tainted: {})", slot->handle.name, reason, s.message());
    if (only_paused) return;
    rc::MutexLock lock(slot->id_mu);
    if (slot->id.suspect.empty()) slot->id.suspect = reason;
    return;
  }
  RC_LOG_ERROR("engine {}: {}", slot->handle.name, reason);
  if (!core_->options.auto_recover) return;
  if (core_->versions == nullptr || core_->options.model.empty()) {
    RC_LOG_WARN("engine {}: --auto-recover needs --directory and --model; the engine stays TAINTED", slot->handle.name);
    return;
  }
  QueueAutoRecovery(slot);
}

void IdentityMonitor::QueueAutoRecovery(EngineSlot* slot) {
  const std::string label = slot->controller->version().label;
  auto id = recover_(core_->options.model, label, slot->index);
  if (!id.ok()) {
    // Refused for now (rollouts still active on the engine, which a recovery waits out): asked
    // again by the driver (RetryAutoRecovery) until it is queued or the engine is not TAINTED.
    RC_LOG_WARN("engine {}: auto-recovery to {}: {}; asking again in {} ms", slot->handle.name, label,
                id.status().ToString(), kAutoRecoverRetryMs);
    slot->auto_recover_retry_ms = SteadyMs() + kAutoRecoverRetryMs;
  } else {
    slot->auto_recover_retry_ms = -1;
    RC_LOG_WARN("engine {}: auto-recovery {} to {} queued", slot->handle.name, *id, label);
  }
}

void IdentityMonitor::RetryAutoRecovery(EngineSlot* slot) {
  const int64_t due = slot->auto_recover_retry_ms.load();
  if (due < 0 || SteadyMs() < due) return;
  if (slot->controller->state() != State::kTainted) {
    slot->auto_recover_retry_ms = -1;  // recovered (or recovering) by other means
    return;
  }
  if (slot->controller->active_count() > 0) {
    // Still refused: asked again later, without queueing (and journaling) a recovery each time.
    slot->auto_recover_retry_ms = SteadyMs() + kAutoRecoverRetryMs;
    return;
  }
  QueueAutoRecovery(slot);
}

Json IdentityMonitor::IdentityJson(const EngineSlot& slot) {
  rc::MutexLock lock(slot.id_mu);
  const VerifiedIdentity id = slot.id;  // a copy: the analysis cannot follow a reference
  return Json{{"verified", id.verified},
              {"boot_id", id.boot_id},
              {"install_generation", id.install_generation},
              {"install_generation_settled", id.generation_settled},
              {"checks", id.checks},
              {"mismatches", id.mismatches},
              {"checked_wall_ms", id.checked_wall_ms},
              {"last_error", id.last_error}};
}

}  // namespace rc::controller
