#pragma once
// The content digest of an FP8 image (docs/fp8.md): a parameter's E4M3 bytes and its scale grid,
// each digested with the sharding-invariant block digest of digest.h, then combined. Holders of
// parts add their parts, and the sums agree however the image is split: the TP ranks of an engine
// digest the boxes of the bytes they hold and the scale groups they own, and the total equals the
// digest of the whole image computed anywhere else (for example from the published bf16 by
// formats/fp8.h's quantizer). A wrong, stale or re-laid-out scale, or another version's bytes,
// changes it.
//
// Thread safety: pure functions.

#include <cstdint>

#include "rolloutcore/base/content_digest.h"
#include "rolloutcore/refit/tensor.h"

namespace rc::refit {

struct Fp8ImageDigest {
  uint64_t bytes = 0;   // D (digest.h) of the E4M3 bytes as an F8_E4M3 tensor of the parameter's shape
  uint64_t scales = 0;  // D of the scales as an F32 tensor of the scale grid's shape

  Fp8ImageDigest& operator+=(const Fp8ImageDigest& o) {
    bytes += o.bytes;
    scales += o.scales;
    return *this;
  }
  friend bool operator==(const Fp8ImageDigest&, const Fp8ImageDigest&) = default;
  // Both sums in one value: xxh3-64 of the tag "rc-fp8-image-1" and the two sums.
  ContentDigest Combined() const;
};

// The part of a holder of `q_box` of the bytes (row-major E4M3 bytes of the box, 2-D: rows of the
// parameter × columns) and of `s_box` of the scale grid (row-major f32 of the box; per tensor the
// grid is {1, 1}, per channel {rows, 1}, block {ceil(rows / 128), ceil(cols / 128)}). A box with no
// elements contributes nothing: a scale every rank holds (per tensor) is owned by one of them.
Fp8ImageDigest Fp8ImagePart(const Shape& param, const Box& q_box, const uint8_t* q, const Shape& grid,
                            const Box& s_box, const float* s);

}  // namespace rc::refit
