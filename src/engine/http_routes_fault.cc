// The fault-injection routes of the embedded engine (tests only: ServerOptions::
// enable_fault_injection; docs/engine.md "Fault injection (tests only)").
#include "engine/http_requests.h"
#include "engine/http_server_impl.h"
#include "rolloutcore/base/log.h"

namespace rc::engine {

using http::SendError;
using http::SendJson;
using http::HttpStatus;

void EngineServer::Impl::FaultRoutes() {
  RC_LOG_WARN("engine: fault injection is enabled (POST /rc/fault); for tests only");
  // The body replaces the whole fault set: a field left out is cleared, {} clears everything.
  server_.Post("/rc/fault", Guard([this](const httplib::Request& q, httplib::Response& r) {
    auto f = ParseFaultBody(q.body);
    if (!f.ok()) return SendError(r, 400, f.status().message());
    if (f->corrupt_live_weight) {
      // One-shot: memory corrupted between updates (docs/refit.md "Anchor checks").
      if (Status c = receiver_.CorruptLiveWeightForTesting(); !c.ok()) return SendError(r, 404, c.message());
      RC_LOG_WARN("engine: fault injection: flipped bit 0 of rank 0's model.norm.weight[0]");
    }
    if (!f->fp8_install.empty()) {
      // One-shot: the FP8 image after the next install (docs/fp8.md, the negative controls).
      auto fault = Fp8FaultFromName(f->fp8_install);
      if (!fault.ok()) return SendError(r, 400, fault.status().message());
      if (Status s = engine_->SetFp8FaultForTesting(*fault); !s.ok()) return SendError(r, HttpStatus(s), s.message());
      RC_LOG_WARN("engine: fault injection: the next install's FP8 image gets {}", f->fp8_install);
    }
    if (f->corrupt_previous_delta) {
      receiver_.SetCorruptPreviousDeltaForTesting(true);
      RC_LOG_WARN("engine: fault injection: the next re-apply of the previous delta flips one of its values");
    }
    faults_.pause_delay_ms = f->pause_delay_ms;
    faults_.install_delay_ms = f->install_delay_ms;
    faults_.reset_delay_ms = f->reset_delay_ms;
    faults_.digest_delay_ms = f->digest_delay_ms;
    faults_.resume_delay_ms = f->resume_delay_ms;
    faults_.refuse_install = f->refuse_install;
    faults_.fail_install_after_first_rank = f->fail_install_after_first_rank;
    receiver_.SetFailAfterFirstRankForTesting(f->fail_install_after_first_rank);
    faults_.corrupt_delta_install = f->corrupt_delta_install;
    receiver_.SetCorruptDeltaInstallForTesting(f->corrupt_delta_install);
    faults_.swap_q_heads = f->swap_q_heads;
    receiver_.SetSwapQHeadsForTesting(f->swap_q_heads);
    RC_LOG_WARN("engine: faults set to {}", faults_.ToJson().dump());
    SendJson(r, 200, faults_.ToJson());
  }));
  server_.Get("/rc/fault", Guard([this](const httplib::Request&, httplib::Response& r) {
    SendJson(r, 200, faults_.ToJson());
  }));
}

}  // namespace rc::engine
