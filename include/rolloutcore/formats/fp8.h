#pragma once
// FP8 E4M3 weights quantized from bf16, bit for bit as vLLM quantizes a bf16 checkpoint
// (docs/fp8.md states the rules, where each comes from in vLLM, and the edge cases).
//
// E4M3FN (OCP "E4M3"; torch.float8_e4m3fn, CUDA __nv_fp8_e4m3): sign, 4 exponent bits (bias 7),
// 3 mantissa bits, no infinities, 0x7F and 0xFF are NaN. Largest finite 448 (0x7E), smallest
// normal 2^-6 (0x08), smallest subnormal 2^-9 (0x01).
//
// One definition, three implementations that give the same bits: the scalar code here, the AVX2 /
// AVX-512 loops (fp8_simd.cc, picked at run time) and the CUDA kernel (src/cuda/fp8_quant.cu).
// Tests hold the scalar rounding against a brute-force nearest-value search, the SIMD loops
// against the scalar code, and (GPU machine) the CUDA kernel against both.

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "rolloutcore/base/status.h"

namespace rc::formats {

inline constexpr float kFp8E4M3Max = 448.0f;
// Block quantization's smallest block amax (vLLM's per_block_cast_to_fp8 clamps to it).
inline constexpr float kFp8BlockMinAmax = 1e-4f;
// Per-channel quantization's smallest scale, 1 / (448 * 512) rounded to f32 (vLLM's
// _fp8_channel_scale clamps to it).
inline constexpr float kFp8ChannelMinScale = 1.0f / 229376.0f;
// 1 / 448 rounded to f32: vLLM's block scale is amax times this (a tensor divided by a Python float
// is a multiplication by its reciprocal in PyTorch's CUDA division kernel).
inline constexpr float kFp8InvMax = 1.0f / 448.0f;

// f32 -> E4M3FN, round to nearest, ties to even, saturating to ±448 (cvt.rn.satfinite.e4m3x2.f32;
// vLLM clamps to ±448 before it, so the saturation is the same). NaN gives 0x7F; the quantizers
// below refuse NaN and infinities before they get here.
uint8_t Fp8E4M3FromF32(float x);
// E4M3FN -> f32, exact. 0x7F / 0xFF give a quiet NaN.
float Fp8E4M3ToF32(uint8_t bits);

// How the scales group the elements of a row-major rows × cols weight (rows = output channels).
enum class Fp8Scheme {
  kPerTensor,   // one scale (vLLM 0.33 --quantization fp8_per_tensor: weight_scale)
  kPerChannel,  // one scale per row, i.e. per output channel (fp8_per_channel)
  kBlock,       // one scale per block_rows × block_cols block, row-major over the block grid
                // (fp8_per_block, DeepSeek-style weight_scale_inv, 128 × 128)
};
std::string_view Fp8SchemeName(Fp8Scheme scheme);  // "per_tensor", "per_channel", "block"
Result<Fp8Scheme> Fp8SchemeFromName(std::string_view name);
// vLLM 0.33's --quantization names of its online FP8 methods: fp8_per_tensor, fp8_per_channel,
// fp8_per_block (InvalidArgument naming the value and the choices otherwise).
std::string_view Fp8VllmQuantization(Fp8Scheme scheme);
Result<Fp8Scheme> Fp8SchemeFromVllmQuantization(std::string_view quantization);

struct Fp8Layout {
  Fp8Scheme scheme = Fp8Scheme::kPerTensor;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t block_rows = 128;  // kBlock only
  int64_t block_cols = 128;
  // The scale grid, {grid rows, grid cols}: per tensor {1, 1}, per channel {rows, 1}, block
  // {ceil(rows / block_rows), ceil(cols / block_cols)}. Scales are held row-major over it.
  std::array<int64_t, 2> ScaleGrid() const;
  // The number of scales: the grid's size.
  int64_t NumScales() const;
  // The scale (index into the row-major grid) of element (row, col).
  int64_t GroupOf(int64_t row, int64_t col) const;
  int64_t NumElements() const { return rows * cols; }
  // InvalidArgument (naming what is wrong) for negative sizes, non-positive blocks, or an
  // element count that overflows.
  Status Validate() const;
};

// The rule, per scheme, for a group with largest magnitude amax (every operation rounded to
// nearest-even in f32; docs/fp8.md says where each comes from in vLLM 0.33):
//  - per tensor:  s = amax / 448;                      q = E4M3(clamp(x * (1 / s)))
//  - per channel: s = max(amax / 448, 1 / 229376);     q = E4M3(clamp(x / s))
//  - block:       s = max(amax, 1e-4) * (1 / 448);     q = E4M3(clamp(x * (1 / s)))
// where clamp(v) = fmax(-448, fmin(v, 448)) (a NaN becomes 448, as fminf makes it in vLLM's
// kernel) and E4M3 is Fp8E4M3FromF32. An all-zero per-tensor weight gets s = 0 and every byte
// 0x7E (0 * inf is NaN), as vLLM's kernel gives it; it dequantizes to zeros all the same.
float Fp8ScaleForAmax(Fp8Scheme scheme, float amax);

// Quantizes a row-major bf16 matrix by the rule above. `q` holds layout.NumElements() bytes and
// `scales` layout.NumScales() floats. A NaN or infinite input is refused (InvalidArgument naming
// `name`, the element's row and column and its bits) and nothing is written. `threads` > 1 splits
// the work over rc::ParallelFor.
Status QuantizeBf16ToFp8(std::span<const uint16_t> bf16, const Fp8Layout& layout, std::span<uint8_t> q,
                         std::span<float> scales, std::string_view name, int threads = 1);

// The same with the scalar code only (the reference the SIMD loops are tested against).
Status QuantizeBf16ToFp8Scalar(std::span<const uint16_t> bf16, const Fp8Layout& layout, std::span<uint8_t> q,
                               std::span<float> scales, std::string_view name);

// ---- Sharded quantization ---------------------------------------------------------------------
// A rank that holds only a box of the matrix (a TP or FSDP shard) gets the same bytes for its box
// as QuantizeBf16ToFp8 of the whole matrix gives there: every holder computes its box's amax per
// scale group (Fp8BoxAmax), the amaxes are merged by max in any order (Fp8MergeAmax; vLLM
// all-reduces them the same way over its TP group), each derives the scales (Fp8ScalesFromAmax)
// and quantizes its box with them (QuantizeBf16BoxToFp8).

// Rows [row0, row0 + rows) × cols [col0, col0 + cols) of the layout's matrix, held row-major.
struct Fp8Box {
  int64_t row0 = 0;
  int64_t col0 = 0;
  int64_t rows = 0;
  int64_t cols = 0;
};

// amax[g] = max(amax[g], largest magnitude in the box of group g), as bf16 magnitude bits
// (layout.NumScales() entries; groups the box does not touch are left as they are). A NaN or
// infinite element is refused naming `name` and its row and column in the whole matrix; `amax` is
// then unchanged.
Status Fp8BoxAmax(std::span<const uint16_t> bf16, const Fp8Layout& layout, const Fp8Box& box,
                  std::span<uint16_t> amax, std::string_view name, int threads = 1);
void Fp8MergeAmax(std::span<const uint16_t> from, std::span<uint16_t> into);
// scales[g] = Fp8ScaleForAmax(layout.scheme, amax[g]).
void Fp8ScalesFromAmax(const Fp8Layout& layout, std::span<const uint16_t> amax, std::span<float> scales);
// Quantizes the box with the whole matrix's scales into q (box.rows × box.cols bytes).
Status QuantizeBf16BoxToFp8(std::span<const uint16_t> bf16, const Fp8Layout& layout, const Fp8Box& box,
                            std::span<const float> scales, std::span<uint8_t> q, std::string_view name,
                            int threads = 1);

// x = Fp8E4M3ToF32(q) * s in f32, per element. InvalidArgument when sizes disagree or a scale is
// negative or not finite.
Status DequantizeFp8ToF32(std::span<const uint8_t> q, std::span<const float> scales, const Fp8Layout& layout,
                          std::span<float> out);

// Which code QuantizeBf16ToFp8 runs here: "avx512", "avx2" or "scalar".
std::string_view Fp8QuantizeIsa();

namespace internal {
// The vector loops (fp8_simd.cc): q = E4M3(clamp(x * factor)), or x / factor when `divide`, for n
// elements; return how many they did (a multiple of their width; the caller does the rest).
int64_t QuantizeRunAvx512(const uint16_t* x, int64_t n, float factor, bool divide, uint8_t* q);
int64_t QuantizeRunAvx2(const uint16_t* x, int64_t n, float factor, bool divide, uint8_t* q);
// One element by the scalar code: E4M3(clamp(x * factor)) or E4M3(clamp(x / factor)).
uint8_t QuantizeOne(uint16_t bf16, float factor, bool divide);
// max |x| over n bf16 as bf16 magnitude bits (0..0x7F7F), or -1 when one is NaN or infinite.
int32_t AbsMaxBitsAvx512(const uint16_t* x, int64_t n);
int32_t AbsMaxBitsAvx2(const uint16_t* x, int64_t n);
bool CpuHasAvx512();
bool CpuHasAvx2();
}  // namespace internal

}  // namespace rc::formats
