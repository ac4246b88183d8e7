#include "rolloutcore/refit/fp8_digest.h"

#include <array>
#include <cstring>

#include "rolloutcore/base/hash.h"
#include "rolloutcore/refit/digest.h"

namespace rc::refit {

ContentDigest Fp8ImageDigest::Combined() const {
  static constexpr char kTag[] = "rc-fp8-image-1";
  std::array<unsigned char, sizeof(kTag) - 1 + 16> buf{};
  std::memcpy(buf.data(), kTag, sizeof(kTag) - 1);
  std::memcpy(buf.data() + sizeof(kTag) - 1, &bytes, 8);
  std::memcpy(buf.data() + sizeof(kTag) - 1 + 8, &scales, 8);
  return ContentDigest(Hash64(buf.data(), buf.size()));
}

Fp8ImageDigest Fp8ImagePart(const Shape& param, const Box& q_box, const uint8_t* q, const Shape& grid,
                            const Box& s_box, const float* s) {
  Fp8ImageDigest d;
  if (q_box.numel() > 0) d.bytes = DigestBlock(DType::kF8E4M3, param, q_box, q);
  if (s_box.numel() > 0) d.scales = DigestBlock(DType::kF32, grid, s_box, s);
  return d;
}

}  // namespace rc::refit
