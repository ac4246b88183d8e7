// Install by exchange (issue 39; docs/vllm.md "Install by exchange"): the staged image becomes the
// live weights without a copy. The vLLM extension lays the staging image out so that each live
// parameter has a twin allocation of its own shape (a "slab") holding, at the live copies' own
// offsets, the dense staging buffers of the copies that tile the parameter; the install then points
// every live parameter at its slab (PyTorch `param.data = slab`) and keeps the old storage as the
// next slab. Whether that makes the live weights exactly the staged bytes is a question of
// addresses, answered here before anything is exchanged:
//
// ExchangeLayoutIssue says why the exchange would NOT make every live copy read the bytes its
// staging copy wrote, or "" when it would: staging copy i and live copy i carry the same source
// box; staging copy i lands densely at the start of its staging buffer, live copy i as a dense box
// of a live parameter of the same dtype; the staging buffer of copy i begins exactly at
// live_after[param of copy i] + dest_offset × element size; every live parameter with copies is in
// live_after with exactly its bytes, and the copies write each of its bytes exactly once (no byte of
// a live parameter keeps what the slab happened to hold).
//
// Thread safety: a pure function over the caller's data.
#pragma once

#include <string>

#include "rolloutcore/refit/capture.h"

namespace rc::receiver::internal {

[[nodiscard]] std::string ExchangeLayoutIssue(const refit::Capture& staging, const refit::Capture& live,
                                              const refit::DestinationBuffers& staging_buffers,
                                              const refit::DestinationBuffers& live_after);

}  // namespace rc::receiver::internal
