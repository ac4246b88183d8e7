// libFuzzer target: the fp8 quantizer (fp8.h) on arbitrary bf16 bits, shapes and schemes. Input:
// byte 0 picks the scheme and block shape, bytes 1-2 the column count, the rest are the bf16
// elements (the row count follows). Checked on every input:
//  - a matrix with a NaN or infinite element is refused, and nothing is written;
//  - otherwise the run-time-picked vector loops give the scalar code's bytes and scales exactly,
//    the scales follow Fp8ScaleForAmax of each group's amax, and every byte is finite (not
//    0x7F / 0xFF) and dequantizes within half an E4M3 step (plus the clamp) of the weight, except
//    under a zero or subnormal per-tensor scale, where vLLM's arithmetic gives 448s by design.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "rolloutcore/formats/fp8.h"

using rc::formats::Fp8Layout;
using rc::formats::Fp8Scheme;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 5) return 0;
  Fp8Layout l;
  l.scheme = static_cast<Fp8Scheme>(data[0] % 3);
  l.block_rows = 1 + (data[0] >> 2) % 8;
  l.block_cols = 1 + (data[0] >> 5) % 8 * 5;
  l.cols = 1 + (data[1] | (data[2] << 8)) % 300;
  const size_t n = (size - 3) / 2;
  l.rows = static_cast<int64_t>(n) / l.cols;
  if (l.rows == 0) return 0;
  std::vector<uint16_t> w(static_cast<size_t>(l.rows * l.cols));
  std::memcpy(w.data(), data + 3, w.size() * 2);
  bool finite = true;
  for (uint16_t b : w) finite = finite && (b & 0x7F80) != 0x7F80;
  std::vector<uint8_t> q0(w.size(), 0xAB), q1(w.size(), 0xAB);
  std::vector<float> s0(static_cast<size_t>(l.NumScales()), -2.0f), s1(s0);
  const rc::Status a = rc::formats::QuantizeBf16ToFp8Scalar(w, l, q0, s0, "w");
  const rc::Status b = rc::formats::QuantizeBf16ToFp8(w, l, q1, s1, "w", 2);
  if (a.ok() != finite || b.ok() != finite) std::abort();
  if (!finite) {
    for (size_t i = 0; i < w.size(); ++i) {
      if (q0[i] != 0xAB || q1[i] != 0xAB) std::abort();
    }
    for (size_t g = 0; g < s0.size(); ++g) {
      if (s0[g] != -2.0f || s1[g] != -2.0f) std::abort();
    }
    return 0;
  }
  if (q0 != q1 || std::memcmp(s0.data(), s1.data(), s0.size() * 4) != 0) std::abort();
  const int64_t gc = (l.cols + l.block_cols - 1) / l.block_cols;
  for (int64_t r = 0; r < l.rows; ++r) {
    for (int64_t c = 0; c < l.cols; ++c) {
      const size_t i = static_cast<size_t>(r * l.cols + c);
      const size_t g = l.scheme == Fp8Scheme::kPerTensor    ? 0
                       : l.scheme == Fp8Scheme::kPerChannel ? static_cast<size_t>(r)
                                                            : static_cast<size_t>((r / l.block_rows) * gc + c / l.block_cols);
      if ((q0[i] & 0x7F) == 0x7F) std::abort();  // never NaN
      const float s = s0[g];
      if (!(s >= 0) || !std::isfinite(s)) std::abort();
      if (l.scheme == Fp8Scheme::kPerTensor && !(s >= 0x1p-126f)) continue;  // vLLM's degenerate scales
      uint32_t u = static_cast<uint32_t>(w[i]) << 16;
      float x;
      std::memcpy(&x, &u, 4);
      const float d = rc::formats::Fp8E4M3ToF32(q0[i]) * s;
      const float bound = std::fabs(x) * 0x1p-4f + s * 0x1p-10f;
      if (!(std::fabs(d - x) <= bound * 1.001f + 1e-30f)) std::abort();
    }
  }
  return 0;
}
