// rolloutcore._core.quantize_fp8 / dequantize_fp8: the fp8 quantizer (formats/fp8.h) for Python, so
// that anyone can compute from a published bf16 tensor the E4M3 bytes and scales vLLM serves
// (tests/vllm compare them with vLLM's own quantization of the same tensor).
#include <fmt/format.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "rolloutcore/formats/fp8.h"
#include "rolloutcore/refit/digest.h"
#include "rolloutcore/refit/fp8_digest.h"
#include "rolloutcore/trainer/fp8_parts.h"
#ifdef ROLLOUTCORE_WITH_CUDA
#include "rolloutcore/cuda/fp8.h"
#include "rolloutcore/cuda/gpu_refit.h"
#endif

namespace rc::python {
namespace py = pybind11;

[[noreturn]] void Raise(const Status& status);  // module.cc

namespace {

formats::Fp8Layout LayoutOf(const py::array& a, const std::string& scheme, std::pair<int64_t, int64_t> block,
                            const char* what) {
  if (a.ndim() != 2) {
    Raise(InvalidArgument(fmt::format("{}: needs a 2-D array (rows = output channels), got {} dimensions", what,
                                      a.ndim())));
  }
  auto s = formats::Fp8SchemeFromName(scheme);
  if (!s.ok()) Raise(s.status());
  formats::Fp8Layout l;
  l.scheme = *s;
  l.rows = a.shape(0);
  l.cols = a.shape(1);
  l.block_rows = block.first;
  l.block_cols = block.second;
  if (Status st = l.Validate(); !st.ok()) Raise(st);
  return l;
}

// The scales' shape as vLLM holds them: per tensor (1,), per channel (rows, 1), block (gr, gc).
std::vector<py::ssize_t> ScaleShape(const formats::Fp8Layout& l) {
  if (l.scheme == formats::Fp8Scheme::kPerTensor) return {1};
  const auto g = l.ScaleGrid();
  return {g[0], g[1]};
}

py::tuple QuantizeFp8(const py::array& bits, const std::string& scheme, std::pair<int64_t, int64_t> block,
                      const std::string& name, int threads) {
  if (!py::isinstance<py::array_t<uint16_t>>(bits)) {
    Raise(InvalidArgument(fmt::format("quantize_fp8: `bits` must be a uint16 array of bf16 bit patterns "
                                      "(torch: t.view(torch.int16).numpy().view(numpy.uint16)), got dtype {}",
                                      py::str(bits.dtype()).cast<std::string>())));
  }
  const auto in = py::array_t<uint16_t, py::array::c_style | py::array::forcecast>::ensure(bits);
  const formats::Fp8Layout l = LayoutOf(in, scheme, block, "quantize_fp8");
  py::array_t<uint8_t> q({l.rows, l.cols});
  py::array_t<float> s(ScaleShape(l));
  Status st;
  {
    py::gil_scoped_release nogil;
    st = formats::QuantizeBf16ToFp8(std::span<const uint16_t>(in.data(), static_cast<size_t>(l.NumElements())), l,
                                    std::span<uint8_t>(q.mutable_data(), static_cast<size_t>(l.NumElements())),
                                    std::span<float>(s.mutable_data(), static_cast<size_t>(l.NumScales())), name,
                                    threads);
  }
  if (!st.ok()) Raise(st);
  return py::make_tuple(q, s);
}

py::array_t<float> DequantizeFp8(const py::array& q, const py::array& scales, const std::string& scheme,
                                 std::pair<int64_t, int64_t> block) {
  const auto qa = py::array_t<uint8_t, py::array::c_style | py::array::forcecast>::ensure(q);
  const auto sa = py::array_t<float, py::array::c_style | py::array::forcecast>::ensure(scales);
  if (!qa || !sa) Raise(InvalidArgument("dequantize_fp8: q must be a uint8 array and scales a float32 array"));
  const formats::Fp8Layout l = LayoutOf(qa, scheme, block, "dequantize_fp8");
  py::array_t<float> out({l.rows, l.cols});
  const Status st = formats::DequantizeFp8ToF32(
      std::span<const uint8_t>(qa.data(), static_cast<size_t>(qa.size())),
      std::span<const float>(sa.data(), static_cast<size_t>(sa.size())), l,
      std::span<float>(out.mutable_data(), static_cast<size_t>(l.NumElements())));
  if (!st.ok()) Raise(st);
  return out;
}

#ifdef ROLLOUTCORE_WITH_CUDA
// The same rule on the GPU (cuda/fp8.h): device addresses of the row-major bf16 matrix, of its
// rows x cols E4M3 bytes and of its scales (the grid, row-major); returns when written. The vLLM
// worker extension quantizes the proven staged bf16 into vLLM's FP8 parameters with it.
void QuantizeFp8Device(int device, uintptr_t bf16, int64_t rows, int64_t cols, const std::string& scheme,
                       uintptr_t q, uintptr_t scales, std::pair<int64_t, int64_t> block, const std::string& name) {
  auto s = formats::Fp8SchemeFromName(scheme);
  if (!s.ok()) Raise(s.status());
  formats::Fp8Layout l{*s, rows, cols, block.first, block.second};
  if (Status st = l.Validate(); !st.ok()) Raise(st);
  if (bf16 == 0 || q == 0 || scales == 0) Raise(InvalidArgument("quantize_fp8_device: a null device address"));
  Status st;
  {
    py::gil_scoped_release nogil;
    st = cuda::QuantizeBf16ToFp8OnDevice(device, reinterpret_cast<const void*>(bf16), l, reinterpret_cast<void*>(q),
                                         reinterpret_cast<float*>(scales), name);
  }
  if (!st.ok()) Raise(st);
}

// The FP8 image digest (refit/fp8_digest.h) of parameters held on the GPU, computed there: each
// entry (name, E4M3 bytes address, rows, cols, f32 scales address, grid rows, grid cols) names a
// row-major [rows, cols] byte matrix and its row-major scale grid. Returns {"parameters": {name:
// {"digest", "bytes_digest", "scales_digest"}}, "combined": CombineTensorDigests over the
// parameters (`model fp8-digest`'s "combined"), "kernel_ms"}. The vLLM worker extension proves
// with it that the FP8 image vLLM computes with is the quantization of the proven bf16.
py::dict Fp8ImageDigestDevice(int device,
                              const std::vector<std::tuple<std::string, uintptr_t, int64_t, int64_t, uintptr_t, int64_t,
                                                           int64_t>>& params) {
  std::vector<cuda::DeviceBlock> blocks;
  blocks.reserve(params.size() * 2);
  for (const auto& [name, q, rows, cols, s, grows, gcols] : params) {
    if (q == 0 || s == 0) Raise(InvalidArgument(fmt::format("fp8_image_digest_device: {}: a null device address", name)));
    if (rows < 0 || cols < 0 || grows <= 0 || gcols <= 0) {
      Raise(InvalidArgument(fmt::format("fp8_image_digest_device: {}: bad shape [{}, {}] or scale grid [{}, {}]", name,
                                        rows, cols, grows, gcols)));
    }
    const refit::Shape shape{rows, cols};
    const refit::Shape grid{grows, gcols};
    blocks.push_back({name + "#bytes", refit::DType::kF8E4M3, shape, refit::FullBox(shape),
                      reinterpret_cast<const void*>(q)});
    blocks.push_back({name + "#scales", refit::DType::kF32, grid, refit::FullBox(grid),
                      reinterpret_cast<const void*>(s)});
  }
  std::vector<uint64_t> sums;
  double kernel_ms = 0;
  {
    py::gil_scoped_release nogil;
    auto digest = cuda::DeviceDigest::ForBlocks(blocks, device);
    if (!digest.ok()) {
      py::gil_scoped_acquire gil;
      Raise(digest.status());
    }
    auto run = digest->RunSlots(&kernel_ms);
    if (!run.ok()) {
      py::gil_scoped_acquire gil;
      Raise(run.status());
    }
    sums = std::move(run).value();
  }
  py::dict per;
  refit::TensorDigests combined;
  for (size_t i = 0; i < params.size(); ++i) {
    const refit::Fp8ImageDigest d{sums[2 * i], sums[2 * i + 1]};
    const std::string& name = std::get<0>(params[i]);
    combined[name] = d.Combined().value();
    py::dict one;
    one["digest"] = d.Combined().ToHex();
    one["bytes_digest"] = ContentDigest(d.bytes).ToHex();
    one["scales_digest"] = ContentDigest(d.scales).ToHex();
    per[py::str(name)] = one;
  }
  py::dict out;
  out["parameters"] = per;
  out["combined"] = ContentDigest(refit::CombineTensorDigests(combined)).ToHex();
  out["kernel_ms"] = kernel_ms;
  return out;
}
#endif

}  // namespace

// ---- The trainer's FP8 parts (trainer/fp8_parts.h) -------------------------------------------

// shards = [(name, global_shape, offset, bits)]: bits a C-contiguous uint16 array of the box (bf16
// bits), kept alive by `keep` while the C++ side reads it.
std::vector<trainer::Fp8ShardInput> ShardInputs(const py::list& shards, std::vector<py::array>* keep) {
  std::vector<trainer::Fp8ShardInput> out;
  for (size_t i = 0; i < shards.size(); ++i) {
    auto t = shards[i].cast<std::tuple<std::string, std::vector<int64_t>, std::vector<int64_t>, py::object>>();
    py::object obj = std::get<3>(t);
    if (!py::isinstance<py::array>(obj) || !py::cast<py::array>(obj).dtype().is(py::dtype::of<uint16_t>())) {
      Raise(InvalidArgument(fmt::format("fp8 parts: shard {} ({}): needs the bf16 bits as a uint16 array", i,
                                        std::get<0>(t))));
    }
    auto a = py::array_t<uint16_t, py::array::c_style>::ensure(obj);
    if (!a) {
      Raise(InvalidArgument(fmt::format("fp8 parts: shard {} ({}): needs the bf16 bits as a uint16 array", i,
                                        std::get<0>(t))));
    }
    refit::Shape extent(a.shape(), a.shape() + a.ndim());
    if (extent.size() != std::get<1>(t).size() || std::get<2>(t).size() != extent.size()) {
      Raise(InvalidArgument(fmt::format("fp8 parts: shard {} ({}): global shape, offset and array disagree in rank",
                                        i, std::get<0>(t))));
    }
    keep->push_back(a);
    out.push_back(trainer::Fp8ShardInput{std::get<0>(t), refit::DType::kBF16, std::get<1>(t),
                                         refit::Box{std::get<2>(t), extent}, a.data()});
  }
  return out;
}

// model = {name: global shape} of the model's bf16 tensors (or None).
std::vector<refit::TensorSpec> ModelSpecs(const py::object& model) {
  std::vector<refit::TensorSpec> out;
  if (model.is_none()) return out;
  for (auto item : model.cast<py::dict>()) {
    out.push_back(refit::TensorSpec{item.first.cast<std::string>(), refit::DType::kBF16,
                                    item.second.cast<std::vector<int64_t>>()});
  }
  return out;
}

py::tuple Fp8LocalAmax(const py::list& shards, const std::string& quantization, int threads, const py::object& model) {
  std::vector<py::array> keep;
  auto inputs = ShardInputs(shards, &keep);
  const auto specs = ModelSpecs(model);
  std::string partial;
  Result<trainer::Fp8Amax> amax = Internal("not run");
  {
    py::gil_scoped_release nogil;
    amax = trainer::Fp8LocalAmax(inputs, quantization, &partial, threads, specs);
  }
  if (!amax.ok()) Raise(amax.status());
  py::dict out;
  for (const auto& [name, v] : *amax) {
    py::array_t<uint16_t> a(std::vector<py::ssize_t>{static_cast<py::ssize_t>(v.size())});
    uint16_t* dst = a.mutable_data();
    for (size_t g = 0; g < v.size(); ++g) dst[g] = v[g];
    out[py::str(name)] = a;
  }
  return py::make_tuple(out, partial);
}

py::list Fp8PartsFromAmax(const py::list& shards, const std::string& quantization, const py::dict& merged,
                          int threads, const py::object& model) {
  std::vector<py::array> keep;
  auto inputs = ShardInputs(shards, &keep);
  const auto specs = ModelSpecs(model);
  trainer::Fp8Amax amax;
  for (auto item : merged) {
    auto a = py::array_t<uint16_t, py::array::c_style | py::array::forcecast>::ensure(item.second);
    if (!a) Raise(InvalidArgument("fp8 parts: merged amax of " + item.first.cast<std::string>() + " is not uint16"));
    amax[item.first.cast<std::string>()] = std::vector<uint16_t>(a.data(), a.data() + a.size());
  }
  Result<std::vector<std::optional<refit::Fp8ImageDigest>>> parts = Internal("not run");
  {
    py::gil_scoped_release nogil;
    parts = trainer::Fp8PartsFromAmax(inputs, quantization, amax, threads, specs);
  }
  if (!parts.ok()) Raise(parts.status());
  py::list out;
  for (const auto& p : *parts) {
    if (p) {
      out.append(py::make_tuple(p->bytes, p->scales));
    } else {
      out.append(py::none());
    }
  }
  return out;
}

void RegisterFp8(py::module_& m) {
  m.def(
      "fp8_parameter_of",
      [](const std::string& tensor) -> py::object {
        auto of = refit::Fp8ParameterOf(tensor);
        if (!of) return py::none();
        return py::make_tuple(of->param, of->part);
      },
      py::arg("tensor"),
      "The FP8 parameter (vLLM's fused name) a checkpoint tensor is a part of, and the part (q, k, v, o, gate, up, "
      "down); None for a tensor served in bf16 (refit/fp8_digest.h).");
  m.def("fp8_local_amax", &Fp8LocalAmax, py::arg("shards"), py::arg("quantization"), py::arg("threads") = 1,
        py::arg("model") = py::none(),
        "A trainer rank's FP8 amaxes (docs/fp8.md, \"The expected image, from the trainer\"): shards = [(name, "
        "global_shape, offset, bf16 bits uint16 array)] -> ({FP8 parameter: uint16 amax per scale group}, the first "
        "group held here only in part, or '' when every group touched is whole here). model: {name: global shape} of the "
        "model's bf16 tensors, for a rank that holds no shard of some part of a fused parameter.");
  m.def("fp8_parts_from_amax", &Fp8PartsFromAmax, py::arg("shards"), py::arg("quantization"), py::arg("merged"),
        py::arg("threads") = 1, py::arg("model") = py::none(),
        "Each shard's FP8 part given the amaxes merged (max) over the trainer's ranks: [(bytes digest, scales "
        "digest) or None for a tensor served in bf16].");
#ifdef ROLLOUTCORE_WITH_CUDA
  m.def("quantize_fp8_device", &QuantizeFp8Device, py::arg("device"), py::arg("bf16"), py::arg("rows"),
        py::arg("cols"), py::arg("scheme"), py::arg("q"), py::arg("scales"),
        py::arg("block") = std::pair<int64_t, int64_t>{128, 128}, py::arg("name") = "tensor",
        "quantize_fp8 on the GPU (CUDA builds): device addresses of the bf16 matrix, its E4M3 bytes and its "
        "scales; the same bits (docs/fp8.md).");
  m.def("fp8_image_digest_device", &Fp8ImageDigestDevice, py::arg("device"), py::arg("params"),
        "The FP8 image digest of parameters on the GPU (CUDA builds): params = [(name, bytes address, rows, cols, "
        "scales address, grid rows, grid cols)]; the digests `rolloutcore model fp8-digest` prints (docs/fp8.md).");
#endif
  m.def("quantize_fp8", &QuantizeFp8, py::arg("bits"), py::arg("scheme") = "per_tensor",
        py::arg("block") = std::pair<int64_t, int64_t>{128, 128}, py::arg("name") = "tensor", py::arg("threads") = 1,
        "bf16 bits (uint16, rows x cols) -> (E4M3 bytes uint8 rows x cols, float32 scales), as vLLM 0.33 "
        "quantizes a bf16 weight (scheme per_tensor, per_channel or block; docs/fp8.md).");
  m.def("dequantize_fp8", &DequantizeFp8, py::arg("q"), py::arg("scales"), py::arg("scheme") = "per_tensor",
        py::arg("block") = std::pair<int64_t, int64_t>{128, 128}, "E4M3 bytes and scales -> float32 values.");
  m.attr("fp8_quantize_isa") = std::string(formats::Fp8QuantizeIsa());
}

}  // namespace rc::python
