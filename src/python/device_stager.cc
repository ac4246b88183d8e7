// rolloutcore._core.DeviceStager (CUDA builds only): the Python binding of
// receiver::DeviceReceiver (include/rolloutcore/receiver/device_receiver.h), the C++ half of the
// vLLM worker extension (python/rolloutcore/vllm.py). Everything the receiver does — discovery,
// plans and imports cached by topology, the device pull, the GPU digests, the fused install — is
// there. The stager is vLLM's receiver::DeviceLiveWeights (live_weights.h): the extension gives it
// two callables that answer, when the receiver asks, where the staging image and the live
// parameters are ({name: (address, bytes)}, read from PyTorch at that moment). This file only
// turns Python lists and dicts into captures and buffer tables and the receiver's typed reports
// into dicts (the extension's JSON edge), and releases the GIL while the receiver works (taking it
// back for the two callables).
//
// Thread safety: one DeviceStager belongs to one worker thread (vLLM runs collective_rpc calls
// one at a time).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <fmt/format.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "rolloutcore/base/content_digest.h"
#include "rolloutcore/cuda/gpu_refit.h"
#include "rolloutcore/receiver/device_receiver.h"
#include "rolloutcore/refit/capture.h"
#include "rolloutcore/refit/manifest.h"

namespace rc::python {
namespace py = pybind11;

[[noreturn]] void Raise(const Status& status);  // module.cc

namespace {

template <typename T>
T Take(Result<T> r) {
  if (!r.ok()) Raise(r.status());
  return std::move(*r);
}

refit::Shape ShapeOf(const py::handle& h) { return h.cast<std::vector<int64_t>>(); }

std::vector<refit::TensorSpec> SpecsFrom(const py::list& params) {
  std::vector<refit::TensorSpec> out;
  for (const py::handle& p : params) {
    auto t = p.cast<py::tuple>();
    refit::TensorSpec s;
    s.name = t[0].cast<std::string>();
    s.dtype = Take(refit::ParseDType(t[1].cast<std::string>()));
    s.shape = ShapeOf(t[2]);
    out.push_back(std::move(s));
  }
  return out;
}

// copies: dicts with source, source_dtype, source_shape, box_start, box_extent, view_to_source,
// param (index), dest_offset, dest_shape, dest_strides, convert.
refit::Capture CaptureFrom(const py::list& params, const py::list& copies) {
  refit::Capture c;
  c.params = SpecsFrom(params);
  for (const py::handle& h : copies) {
    auto d = h.cast<py::dict>();
    refit::CapturedCopy cc;
    cc.source = d["source"].cast<std::string>();
    cc.source_dtype = Take(refit::ParseDType(d["source_dtype"].cast<std::string>()));
    cc.source_shape = ShapeOf(d["source_shape"]);
    cc.box.start = ShapeOf(d["box_start"]);
    cc.box.extent = ShapeOf(d["box_extent"]);
    cc.view_to_source = d["view_to_source"].cast<std::vector<int32_t>>();
    cc.param = d["param"].cast<uint32_t>();
    if (cc.param >= c.params.size()) {
      Raise(InvalidArgument(fmt::format("copy of {} names parameter {} of {}", cc.source, cc.param, c.params.size())));
    }
    cc.dest_offset = d["dest_offset"].cast<int64_t>();
    cc.dest_shape = ShapeOf(d["dest_shape"]);
    cc.dest_strides = ShapeOf(d["dest_strides"]);
    cc.convert = d["convert"].cast<bool>();
    c.copies.push_back(std::move(cc));
  }
  return c;
}

// {name: (address, bytes)} of device memory -> DestinationBuffers (InvalidArgument, naming the
// callable and the entry, when it is anything else).
Result<refit::DestinationBuffers> BuffersFrom(const py::handle& buffers, const char* what) {
  try {
    refit::DestinationBuffers out;
    for (const auto& [k, v] : buffers.cast<py::dict>()) {
      auto t = v.cast<py::tuple>();
      if (t.size() != 2) {
        return InvalidArgument(fmt::format("{}: entry {} is not (address, bytes)", what, py::str(k).cast<std::string>()));
      }
      // A device address Python passes as an int (torch data_ptr()): the cast is the interface.
      auto* p = reinterpret_cast<std::byte*>(t[0].cast<uintptr_t>());  // NOLINT(performance-no-int-to-ptr)
      out.emplace(k.cast<std::string>(), std::span<std::byte>(p, t[1].cast<uint64_t>()));
    }
    return out;
  } catch (const py::cast_error& e) {
    return InvalidArgument(fmt::format("{} must return {{name: (address, bytes)}}: {}", what, e.what()));
  }
}

// Calls a buffers callable with the GIL (the receiver asks from a thread that released it).
Result<refit::DestinationBuffers> CallBuffers(const py::function& f, const char* what) {
  py::gil_scoped_acquire gil;
  try {
    return BuffersFrom(f(), what);
  } catch (py::error_already_set& e) {
    return InvalidArgument(fmt::format("{} raised: {}", what, e.what()));
  }
}

py::dict DigestsDict(const refit::TensorDigests& d) {
  py::dict out;
  for (const auto& [name, v] : d) out[py::str(name)] = DigestHex(v);
  return out;
}

py::dict DigestReportDict(const receiver::DeviceDigestReport& r, const char* source) {
  py::dict out;
  out["tensors"] = DigestsDict(r.tensors);
  out["content_digest"] = r.content_digest.ToHex();
  out["kernel_ms"] = r.kernel_ms;
  out["digest_ms"] = r.digest_ms;
  out["source"] = source;
  return out;
}

// A DevicePrepareReport as the extension reads it; `units` names what `chunks` counts.
py::dict PrepareDict(const receiver::DevicePrepareReport& r, const char* units) {
  py::dict out;
  out["ok"] = r.ok;
  if (!r.ok) {
    out["reason"] = r.reason;
    return out;
  }
  out[units] = r.chunks;
  out["bytes"] = r.bytes;
  out["elements"] = r.elements;
  out["prepare_ms"] = r.prepare_ms;
  return out;
}

// Runs `f` (a DeviceReceiver call returning Result<T>) without the GIL; raises its error.
template <typename F>
auto WithoutGil(F&& f) {
  decltype(f()) r = [&] {
    py::gil_scoped_release nogil;
    return f();
  }();
  if (!r.ok()) Raise(r.status());
  return std::move(*r);
}

class PyDeviceStager final : public receiver::DeviceLiveWeights {
 public:
  PyDeviceStager(int device, py::function staging_buffers, py::function live_buffers)
      : staging_buffers_(std::move(staging_buffers)),
        live_buffers_(std::move(live_buffers)),
        receiver_(Take(receiver::DeviceReceiver::Create(device, this))) {}

  // receiver::DeviceLiveWeights
  Result<refit::DestinationBuffers> StagingBuffers() override { return CallBuffers(staging_buffers_, "staging_buffers"); }
  Result<refit::DestinationBuffers> LiveBuffers() override { return CallBuffers(live_buffers_, "live_buffers"); }

  void SetCaptures(const py::list& staging_params, const py::list& staging_copies, const py::list& live_params,
                   const py::list& live_copies) {
    if (Status s = receiver_->SetCaptures(CaptureFrom(staging_params, staging_copies),
                                          CaptureFrom(live_params, live_copies));
        !s.ok()) {
      Raise(s);
    }
  }

  py::dict Stage(const std::string& directory, const std::string& model, const std::string& version,
                 int64_t timeout_ms, int64_t pull_delay_ms, const std::string& delta_policy) {
    auto policy = receiver::ParseDeltaPolicy(delta_policy);
    if (!policy.ok()) Raise(policy.status().WithContext("stage: delta_policy"));
    receiver::DeviceStageRequest req;
    req.directory = directory;
    req.model = model;
    req.version = version;
    req.timeout_ms = timeout_ms;
    req.delta_policy = *policy;
    req.pull_delay_ms = pull_delay_ms;
    const receiver::DeviceStageReport r = WithoutGil([&] { return receiver_->Stage(req); });
    py::dict stages;
    for (const auto& [k, v] : r.stage_ms) stages[py::str(k)] = v;
    py::dict out;
    out["stage_ms"] = stages;
    out["mode"] = r.mode;
    out["delta_ineligible"] = r.delta_ineligible;
    if (r.delta_choice) {
      // The stage answer's delta_choice (refit_choice.h DeltaChoice::ToJson), as a dict.
      py::dict c;
      c["policy"] = std::string(receiver::DeltaPolicyName(r.delta_choice->policy));
      c["mode"] = r.delta_choice->delta ? "delta" : "full";
      c["reason"] = r.delta_choice->reason;
      c["estimated_full_ms"] = r.delta_choice->full_ms < 0 ? py::object(py::none()) : py::object(py::float_(r.delta_choice->full_ms));
      c["estimated_delta_ms"] = r.delta_choice->delta_ms < 0 ? py::object(py::none()) : py::object(py::float_(r.delta_choice->delta_ms));
      c["full_samples"] = r.delta_choice->full_samples;
      c["delta_samples"] = r.delta_choice->delta_samples;
      out["delta_choice"] = c;
    } else {
      out["delta_choice"] = py::none();
    }
    out["changed"] = r.changed;
    out["delta_writes"] = r.delta_writes;
    out["bytes_uploaded"] = r.bytes_uploaded;
    out["transport"] = r.transport;
    out["bytes_needed"] = r.bytes_needed;
    out["bytes_planned"] = r.bytes_planned;
    out["bytes_pulled"] = r.bytes_pulled;
    out["descriptors"] = r.descriptors;
    out["reads"] = r.reads;
    out["plan_cached"] = r.plan_cached;
    out["digest_table_cached"] = r.digest_table_cached;
    out["staged_digest"] = r.staged_digest.ToHex();
    out["manifest_digest"] = r.manifest_digest.ToHex();
    out["published"] = DigestsDict(r.published);
    return out;
  }

  py::dict LiveDigest() {
    const receiver::DeviceDigestReport r = WithoutGil([&] { return receiver_->LiveDigest(); });
    py::dict out = DigestReportDict(r, "reread");
    out["table_cached"] = r.table_cached;
    return out;
  }

  // {ok: true, chunks, bytes, elements, prepare_ms} or {ok: false, reason}.
  py::dict PrepareInstall() {
    return PrepareDict(WithoutGil([&] { return receiver_->PrepareInstall(); }), "chunks");
  }

  // {ok: true, parameters, bytes, elements (0), prepare_ms} or {ok: false, reason} (nothing kept):
  // install by exchange, `live_after` = {live parameter: (address, bytes)} of the slabs
  // (device_receiver.h).
  py::dict PrepareExchange(const py::dict& live_after) {
    refit::DestinationBuffers after = Take(BuffersFrom(live_after, "prepare_exchange: live_after"));
    return PrepareDict(WithoutGil([&] { return receiver_->PrepareExchange(after); }), "parameters");
  }

  // The live digest after the exchange: {tensors, content_digest, kernel_ms, digest_ms, source:
  // "reread" | "staged", table_cached}.
  py::dict CompleteExchange(bool reread) {
    const receiver::DeviceDigestReport r = WithoutGil([&] { return receiver_->CompleteExchange(reread); });
    py::dict out = DigestReportDict(r, r.staged ? "staged" : "reread");
    out["table_cached"] = r.table_cached;
    return out;
  }

  // {ok: true, tensors, content_digest, kernel_ms, digest_ms, bytes, source: "fused"} or
  // {ok: false, reason} (nothing written).
  py::dict Install() {
    const receiver::DeviceInstallReport r = WithoutGil([&] { return receiver_->Install(); });
    if (!r.ok) {
      py::dict refused;
      refused["ok"] = false;
      refused["reason"] = r.reason;
      return refused;
    }
    py::dict out = DigestReportDict(r.digest, "fused");
    out["ok"] = true;
    out["bytes"] = r.bytes;
    return out;
  }

 private:
  py::function staging_buffers_, live_buffers_;
  std::unique_ptr<receiver::DeviceReceiver> receiver_;
};

}  // namespace

void RegisterDeviceStager(py::module_& m) {
  py::class_<PyDeviceStager>(m, "DeviceStager")
      .def(py::init<int, py::function, py::function>(), py::arg("device"), py::arg("staging_buffers"),
           py::arg("live_buffers"))
      .def("set_captures", &PyDeviceStager::SetCaptures, py::arg("staging_params"), py::arg("staging_copies"),
           py::arg("live_params"), py::arg("live_copies"))
      .def("stage", &PyDeviceStager::Stage, py::arg("directory"), py::arg("model"), py::arg("version"),
           py::arg("timeout_ms"), py::arg("pull_delay_ms") = 0, py::arg("delta_policy") = "auto")
      .def("live_digest", &PyDeviceStager::LiveDigest)
      .def("prepare_install", &PyDeviceStager::PrepareInstall)
      .def("install", &PyDeviceStager::Install)
      .def("prepare_exchange", &PyDeviceStager::PrepareExchange, py::arg("live_after"))
      .def("complete_exchange", &PyDeviceStager::CompleteExchange, py::arg("reread") = true);
  // GPU milliseconds of a plain 16-byte-load read of `nbytes` at device address `address`.
  m.def(
      "read_sweep_ms",
      [](uintptr_t address, uint64_t nbytes, int device) {
        Result<double> r = Result<double>(0.0);
        {
          py::gil_scoped_release nogil;
          r = cuda::TimedReadSweep(reinterpret_cast<const void*>(address), nbytes,  // NOLINT(performance-no-int-to-ptr)
                                   device);  // a device address from Python (data_ptr())
        }
        if (!r.ok()) Raise(r.status());
        return *r;
      },
      py::arg("address"), py::arg("nbytes"), py::arg("device"));
}

}  // namespace rc::python
