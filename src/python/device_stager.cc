// rolloutcore._core.DeviceStager (CUDA builds only): the C++ half of the vLLM worker extension
// (python/rolloutcore/vllm.py). The extension captures vLLM's own load_weights into two
// descriptions of the same copies:
//   * the staging capture: every recorded copy lands in its own dense staging parameter (device
//     memory the extension allocates once and keeps), so the planner's coverage proof is exact;
//   * the live capture: the same copies with the real destination (live vLLM parameter, element
//     offset and strides), used to digest the live weights in source coordinates.
// Stage() discovers the committed manifest, plans this rank's reads (cached while the source
// topology is unchanged), pulls them with the manifest's transport (cuda_ipc / nccl: device to
// device, no host copy) into the staging buffers, and checks the staged bytes against the
// published per-tensor digests on the GPU. LiveDigest() digests the live parameters through the
// live capture (DeviceDigest::ForInstalled, the same definition as everywhere in rolloutcore;
// the uploaded table is kept while the live addresses are unchanged).
// PrepareInstall() (called after a stage, while vLLM still serves) builds and uploads the fused
// install table (DeviceInstall: staging -> live copies that digest what they write, one launch);
// Install() only launches it, so the extension calls it only while vLLM is paused. Nothing else
// here writes a live parameter.
//
// Thread safety: one DeviceStager belongs to one worker thread (vLLM runs collective_rpc calls
// one at a time); every method releases the GIL while it waits on the GPU or the network.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <fmt/format.h>

#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "rolloutcore/base/hash.h"
#include "rolloutcore/cuda/gpu_refit.h"
#include "rolloutcore/directory/client.h"
#include "rolloutcore/refit/capture.h"
#include "rolloutcore/refit/digest.h"
#include "rolloutcore/refit/manifest.h"
#include "rolloutcore/refit/planner.h"
#include "rolloutcore/receiver/source_imports.h"

namespace rc::python {
namespace py = pybind11;

[[noreturn]] void Raise(const Status& status);  // module.cc

namespace {

double MsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

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

// {name: (address, bytes)} of device memory -> DestinationBuffers.
refit::DestinationBuffers BuffersFrom(const py::dict& buffers) {
  refit::DestinationBuffers out;
  for (const auto& [k, v] : buffers) {
    auto t = v.cast<py::tuple>();
    auto* p = reinterpret_cast<std::byte*>(t[0].cast<uintptr_t>());
    out.emplace(k.cast<std::string>(), std::span<std::byte>(p, t[1].cast<uint64_t>()));
  }
  return out;
}

// Identity of a set of buffers (names, addresses, sizes): a cached device table stays valid while
// it is unchanged.
uint64_t BuffersKey(const refit::DestinationBuffers& b) {
  Hasher h;
  for (const auto& [name, span] : b) {
    h.Update(name);
    h.UpdateU64(reinterpret_cast<uint64_t>(span.data()));
    h.UpdateU64(span.size());
  }
  return h.Digest();
}

py::dict DigestsDict(const refit::TensorDigests& d) {
  py::dict out;
  for (const auto& [name, v] : d) out[py::str(name)] = Hex64(v);
  return out;
}

class PyDeviceStager {
 public:
  explicit PyDeviceStager(int device) : device_(device) {
    if (device < 0 || device >= cuda::DeviceCount()) {
      Raise(InvalidArgument(fmt::format("device {} is not one of the {} visible CUDA devices", device,
                                        cuda::DeviceCount())));
    }
  }

  void SetCaptures(const py::list& staging_params, const py::list& staging_copies, const py::list& live_params,
                   const py::list& live_copies) {
    refit::Capture staging = CaptureFrom(staging_params, staging_copies);
    refit::Capture live = CaptureFrom(live_params, live_copies);
    // The staging capture writes every staging byte exactly once, by construction; prove it.
    if (Status s = refit::CheckDestinationCoverage(staging); !s.ok()) Raise(s.WithContext("staging capture"));
    staging_ = std::move(staging);
    live_ = std::move(live);
    const refit::Capture* ranks[] = {&live_};
    live_regions_ = refit::AssignDigestOwnership(ranks)[0];
    const refit::Capture* sranks[] = {&staging_};
    staging_regions_ = refit::AssignDigestOwnership(sranks)[0];
    plan_.reset();
    imports_.reset();
    transport_.reset();
    topology_ = 0;
    live_digest_.reset();
    install_.reset();
    install_key_ = live_digest_key_ = 0;
  }

  // pull_delay_ms > 0 (fault injection for tests, rc_fault stage_pull_delay_ms; 0 in production):
  // holds the pull that long (within the deadline) after the source memory was imported and
  // before the reads are posted, so a test can kill the trainer mid-pull.
  py::dict Stage(const std::string& directory, const std::string& model, const std::string& version,
                 int64_t timeout_ms, const py::dict& staging_buffers, int64_t pull_delay_ms) {
    if (staging_.copies.empty()) Raise(FailedPrecondition("DeviceStager: set_captures was not called"));
    if (timeout_ms <= 0) Raise(InvalidArgument(fmt::format("timeout_ms must be positive, got {}", timeout_ms)));
    refit::DestinationBuffers buffers = BuffersFrom(staging_buffers);
    py::dict stages;
    py::dict out;
    {
      py::gil_scoped_release nogil;
      Status st = StageLocked(directory, model, version, timeout_ms, buffers, pull_delay_ms);
      if (!st.ok()) {
        py::gil_scoped_acquire gil;
        Raise(st);
      }
    }
    for (const auto& [k, v] : last_stages_) stages[py::str(k)] = v;
    out["stage_ms"] = stages;
    out["transport"] = transport_name_;
    out["bytes_needed"] = plan_->stats.bytes_needed;
    out["bytes_planned"] = plan_->stats.bytes_planned;
    out["bytes_pulled"] = last_stats_.bytes_read;
    out["descriptors"] = plan_->stats.descriptors;
    out["reads"] = last_stats_.reads;
    out["plan_cached"] = last_plan_cached_;
    out["staged_digest"] = Hex64(refit::CombineTensorDigests(staged_));
    out["manifest_digest"] = Hex64(manifest_digest_);
    out["published"] = DigestsDict(published_);
    return out;
  }

  // Per-tensor digests of the live parameters ({name: (address, bytes)}) through the live capture.
  // The uploaded table is kept while the buffers (names, addresses, sizes) are unchanged.
  py::dict LiveDigest(const py::dict& live_buffers) {
    if (live_.copies.empty()) Raise(FailedPrecondition("DeviceStager: set_captures was not called"));
    refit::DestinationBuffers buffers = BuffersFrom(live_buffers);
    refit::TensorDigests d;
    double kernel_ms = 0;
    bool cached = false;
    const auto t0 = std::chrono::steady_clock::now();
    {
      py::gil_scoped_release nogil;
      const uint64_t key = BuffersKey(buffers);
      cached = live_digest_ && key == live_digest_key_;
      Status st = OkStatus();
      if (!cached) {
        live_digest_.reset();
        auto digest = cuda::DeviceDigest::ForInstalled(live_, buffers, live_regions_, device_);
        if (digest.ok()) {
          live_digest_ = std::make_unique<cuda::DeviceDigest>(std::move(*digest));
          live_digest_key_ = key;
        } else {
          st = digest.status();
        }
      }
      Result<refit::TensorDigests> r = st.ok() ? live_digest_->Run(&kernel_ms) : Result<refit::TensorDigests>(st);
      if (!r.ok()) {
        py::gil_scoped_acquire gil;
        Raise(r.status().WithContext("live digest"));
      }
      d = std::move(*r);
    }
    py::dict out;
    out["tensors"] = DigestsDict(d);
    out["content_digest"] = Hex64(refit::CombineTensorDigests(d));
    out["kernel_ms"] = kernel_ms;
    out["digest_ms"] = MsSince(t0);
    out["table_cached"] = cached;
    out["source"] = "reread";
    return out;
  }

  // Builds and uploads the fused install table for these buffers (kept while they are unchanged).
  // Never writes a live byte. {ok: true, chunks, bytes, elements, prepare_ms} or {ok: false,
  // reason} when the copies cannot run in one launch (overlapping live elements): the caller then
  // copies in order and digests afterwards.
  py::dict PrepareInstall(const py::dict& staging_buffers, const py::dict& live_buffers) {
    if (live_.copies.empty()) Raise(FailedPrecondition("DeviceStager: set_captures was not called"));
    refit::DestinationBuffers sb = BuffersFrom(staging_buffers), lb = BuffersFrom(live_buffers);
    py::dict out;
    const auto t0 = std::chrono::steady_clock::now();
    Status st = OkStatus();
    {
      py::gil_scoped_release nogil;
      const uint64_t key = BuffersKey(sb) * 31 + BuffersKey(lb);
      if (!install_ || key != install_key_) {
        install_.reset();
        auto di = cuda::DeviceInstall::Prepare(live_, lb, staging_, sb, live_regions_, device_);
        if (di.ok()) {
          install_ = std::make_unique<cuda::DeviceInstall>(std::move(*di));
          install_key_ = key;
        } else {
          st = di.status();
        }
      }
    }
    if (!st.ok()) {
      if (st.code() != StatusCode::kFailedPrecondition) Raise(st.WithContext("preparing the fused install"));
      out["ok"] = false;
      out["reason"] = st.ToString();
      return out;
    }
    out["ok"] = true;
    out["chunks"] = install_->chunks();
    out["bytes"] = install_->bytes();
    out["elements"] = install_->elements();
    out["prepare_ms"] = MsSince(t0);
    return out;
  }

  // Launches the prepared fused install: writes every live destination of the staging copies and
  // returns the digest of what it wrote. Only while the engine is paused (the caller's duty).
  // {ok: false, reason} without writing anything when nothing was prepared for exactly these
  // buffers (e.g. a parameter moved since the stage).
  py::dict Install(const py::dict& staging_buffers, const py::dict& live_buffers) {
    {
      refit::DestinationBuffers sb = BuffersFrom(staging_buffers), lb = BuffersFrom(live_buffers);
      if (!install_ || BuffersKey(sb) * 31 + BuffersKey(lb) != install_key_) {
        py::dict refused;
        refused["ok"] = false;
        refused["reason"] = install_ ? "the buffers changed since prepare_install" : "prepare_install did not succeed";
        return refused;
      }
    }
    refit::TensorDigests d;
    double kernel_ms = 0;
    const auto t0 = std::chrono::steady_clock::now();
    {
      py::gil_scoped_release nogil;
      Result<refit::TensorDigests> r = install_->Run(&kernel_ms);
      if (!r.ok()) {
        py::gil_scoped_acquire gil;
        Raise(r.status().WithContext("fused install"));
      }
      d = std::move(*r);
    }
    py::dict out;
    out["ok"] = true;
    out["tensors"] = DigestsDict(d);
    out["content_digest"] = Hex64(refit::CombineTensorDigests(d));
    out["kernel_ms"] = kernel_ms;
    out["digest_ms"] = MsSince(t0);
    out["bytes"] = install_->bytes();
    out["source"] = "fused";
    return out;
  }

 private:
  Status StageLocked(const std::string& directory, const std::string& model, const std::string& version,
                     int64_t timeout_ms, const refit::DestinationBuffers& buffers, int64_t pull_delay_ms) {
    last_stages_.clear();
    const auto t_total = std::chrono::steady_clock::now();
    auto t = t_total;
    directory::DirectoryClient dir(directory);
    RC_ASSIGN_OR_RETURN(refit::Manifest manifest, dir.Get(model, version));
    RC_ASSIGN_OR_RETURN(refit::TensorDigests published, refit::TensorDigestsFromShards(manifest));
    last_stages_["discover"] = MsSince(t);

    t = std::chrono::steady_clock::now();
    const uint64_t topo = refit::SourceTopologyDigest(manifest);
    last_plan_cached_ = plan_ && topo == topology_;
    if (!last_plan_cached_) {
      imports_.reset();
      plan_.reset();
      RC_ASSIGN_OR_RETURN(refit::TransferPlan p, refit::BuildPlan(staging_, manifest, refit::PlanOptions{}));
      plan_ = std::make_unique<refit::TransferPlan>(std::move(p));
      transport::TransportOptions topts;
      topts.device = device_;
      RC_ASSIGN_OR_RETURN(transport_, receiver::CreateManifestTransport(manifest, topts, &transport_name_));
      topology_ = topo;
    }
    last_stages_["plan"] = MsSince(t);

    t = std::chrono::steady_clock::now();
    if (!imports_) {
      RC_ASSIGN_OR_RETURN(imports_, cuda::PlanImports::Import(*plan_, *transport_));
    }
    last_stages_["import"] = MsSince(t);

    if (pull_delay_ms > 0) {
      t = std::chrono::steady_clock::now();
      const int64_t left = timeout_ms - static_cast<int64_t>(MsSince(t_total));
      std::this_thread::sleep_for(std::chrono::milliseconds(std::max<int64_t>(0, std::min(pull_delay_ms, left))));
      last_stages_["fault_pull_delay"] = MsSince(t);
    }

    t = std::chrono::steady_clock::now();
    cuda::DeviceExecuteOptions eo;
    eo.device = device_;
    eo.timeout_ms = std::max<int64_t>(1, timeout_ms - static_cast<int64_t>(MsSince(t_total)));
    auto stats = cuda::ExecutePlanOnDevice(*plan_, *imports_, buffers, eo);
    if (!stats.ok()) {
      // A failed pull may leave imports to a dead owner: import again next time.
      imports_.reset();
      return stats.status().WithContext(fmt::format("pulling {} of {} into GPU staging", version, model));
    }
    last_stats_ = *stats;
    last_stages_["wire"] = MsSince(t);

    t = std::chrono::steady_clock::now();
    RC_ASSIGN_OR_RETURN(cuda::DeviceDigest digest,
                        cuda::DeviceDigest::ForInstalled(staging_, buffers, staging_regions_, device_));
    RC_ASSIGN_OR_RETURN(refit::TensorDigests got, digest.Run());
    last_stages_["digest"] = MsSince(t);
    // The engine loads a subset of the manifest's tensors when it ignores some (e.g. a tied
    // lm_head): compare what it staged; the caller reports what it did not load.
    refit::TensorDigests want;
    for (const auto& [name, v] : got) {
      auto it = published.find(name);
      if (it == published.end()) return DataLoss(fmt::format("staged tensor {} is not in {} of {}", name, version, model));
      want.emplace(name, it->second);
    }
    std::string mismatch = refit::FirstDigestMismatch(got, want);
    if (!mismatch.empty()) {
      return DataLoss(fmt::format("staged bytes of {} do not match the published digests: {}", version, mismatch));
    }
    staged_ = std::move(got);
    published_ = std::move(published);
    manifest_digest_ = manifest.content_digest;
    last_stages_["total"] = MsSince(t_total);
    return OkStatus();
  }

  int device_;
  refit::Capture staging_;
  refit::Capture live_;
  std::vector<refit::DigestRegion> staging_regions_;
  std::vector<refit::DigestRegion> live_regions_;
  std::unique_ptr<refit::TransferPlan> plan_;
  std::unique_ptr<transport::Transport> transport_;
  std::unique_ptr<cuda::PlanImports> imports_;
  std::string transport_name_;
  uint64_t topology_ = 0;
  bool last_plan_cached_ = false;
  refit::ExecuteStats last_stats_;
  std::map<std::string, double> last_stages_;
  refit::TensorDigests staged_;
  refit::TensorDigests published_;
  std::unique_ptr<cuda::DeviceDigest> live_digest_;
  uint64_t live_digest_key_ = 0;
  std::unique_ptr<cuda::DeviceInstall> install_;
  uint64_t install_key_ = 0;
  uint64_t manifest_digest_ = 0;
};

}  // namespace

void RegisterDeviceStager(py::module_& m) {
  py::class_<PyDeviceStager>(m, "DeviceStager")
      .def(py::init<int>(), py::arg("device"))
      .def("set_captures", &PyDeviceStager::SetCaptures, py::arg("staging_params"), py::arg("staging_copies"),
           py::arg("live_params"), py::arg("live_copies"))
      .def("stage", &PyDeviceStager::Stage, py::arg("directory"), py::arg("model"), py::arg("version"),
           py::arg("timeout_ms"), py::arg("staging_buffers"), py::arg("pull_delay_ms") = 0)
      .def("live_digest", &PyDeviceStager::LiveDigest, py::arg("live_buffers"))
      .def("prepare_install", &PyDeviceStager::PrepareInstall, py::arg("staging_buffers"), py::arg("live_buffers"))
      .def("install", &PyDeviceStager::Install, py::arg("staging_buffers"), py::arg("live_buffers"));
  // GPU milliseconds of a plain 16-byte-load read of `nbytes` at device address `address`.
  m.def(
      "read_sweep_ms",
      [](uintptr_t address, uint64_t nbytes, int device) {
        Result<double> r = Result<double>(0.0);
        {
          py::gil_scoped_release nogil;
          r = cuda::TimedReadSweep(reinterpret_cast<const void*>(address), nbytes, device);
        }
        if (!r.ok()) Raise(r.status());
        return *r;
      },
      py::arg("address"), py::arg("nbytes"), py::arg("device"));
}

}  // namespace rc::python
