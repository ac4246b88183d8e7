// rolloutcore._core: the compiled half of the Python package (docs/python.md). It binds the trainer
// Publisher (shards registered zero-copy from numpy / torch memory), shared-memory allocation for
// the shm transport, the refit planner's statistics, model tensor listings and content digests.
// Everything that is plain HTTP (directory reads, the controller, the engine) is pure Python in
// python/rolloutcore/, so it works where this extension was not built.
//
// Errors: every rc::Status that is not OK is raised as the rolloutcore.errors class for its code
// (InvalidArgumentError is also a ValueError, NotFoundError a LookupError, ...), with the C++
// message, which names the tensor, rank and version.
//
// Thread safety: the GIL serializes callers; Publisher.publish and plan() release it while they
// digest, register, plan and talk to the directory, so other Python threads run meanwhile. A
// Publisher may be used from several Python threads (its C++ object is thread-safe and the shard
// records here have their own mutex).
#include <fmt/format.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "python/array_memory.h"
#include "rolloutcore/base/content_digest.h"
#include "rolloutcore/base/hash.h"
#include "rolloutcore/base/mutex.h"
#include "rolloutcore/directory/client.h"
#include "rolloutcore/directory/types.h"
#include "rolloutcore/net/http.h"
#include "rolloutcore/refit/delta.h"
#include "rolloutcore/refit/digest.h"
#include "rolloutcore/refit/layouts.h"
#include "rolloutcore/refit/model_config.h"
#include "rolloutcore/refit/plan_stats_json.h"
#include "rolloutcore/refit/planner.h"
#include "rolloutcore/refit/probes.h"
#include "rolloutcore/refit/tensor.h"
#ifdef ROLLOUTCORE_WITH_CUDA
#include "rolloutcore/cuda/gpu_refit.h"
#endif
#include "rolloutcore/trainer/publisher.h"
#include "rolloutcore/transport/registry.h"

namespace rc::python {

[[noreturn]] void Raise(const Status& s) {
  py::object errors = py::module_::import("rolloutcore.errors");
  const std::string code(StatusCodeName(s.code()));
  py::object cls = errors.attr("error_class")(code);
  py::object exc = cls(s.message());
  PyErr_SetObject(cls.ptr(), exc.ptr());
  throw py::error_already_set();
}

void RegisterFp8(py::module_& m);  // fp8.cc
#ifdef ROLLOUTCORE_WITH_CUDA
void RegisterDeviceStager(py::module_& m);  // device_stager.cc
#endif

namespace {

void Check(const Status& s) {
  if (!s.ok()) Raise(s);
}

template <typename T>
T Unwrap(Result<T> r) {
  if (!r.ok()) Raise(r.status());
  return std::move(r).value();
}

std::optional<refit::DType> DTypeArg(const py::object& dtype) {
  if (dtype.is_none()) return std::nullopt;
  std::string text;
  if (py::isinstance<py::str>(dtype)) {
    text = dtype.cast<std::string>();
  } else {
    text = py::str(dtype).cast<std::string>();
    if (text.rfind("torch.", 0) == 0) {
      text = text.substr(6);
    } else {
      text = py::module_::import("numpy").attr("dtype")(dtype).attr("name").cast<std::string>();
    }
  }
  return Unwrap(refit::ParseDType(text));
}

// A tensor digest as Python hands it over: an int, or the one text form (16 hex digits).
uint64_t ParseDigest(const py::handle& value, const std::string& name) {
  if (py::isinstance<py::int_>(value)) return value.cast<uint64_t>();
  return Unwrap(ContentDigest::ParseHex(py::str(value).cast<std::string>(), "digest of tensor " + name));
}

py::list ShapeList(const refit::Shape& shape) {
  py::list out;
  for (int64_t d : shape) out.append(d);
  return out;
}

// ---- Publisher ----------------------------------------------------------------------------------

struct ShardRecord {
  std::string name;
  refit::DType dtype = refit::DType::kBF16;
  refit::Shape global_shape;
  refit::Shape offset;
  refit::Shape local_shape;
  uintptr_t data = 0;
  uint64_t bytes = 0;
  std::string source;
  std::string handle;   // after publish
  uint64_t digest = 0;  // after publish
  bool published = false;
};

#ifdef ROLLOUTCORE_WITH_CUDA
// PublisherOptions::device_digester: every shard's DigestBlock on its GPU, one kernel launch per
// device over all of that device's shards (one launch per shard cost ~0.25 ms each, 0.2 s for a
// two-rank 8B model of 399 tensors).
Result<std::vector<uint64_t>> DigestShardsOnTheirGpus(const std::vector<const trainer::ShardSource*>& shards) {
  std::map<int32_t, std::vector<size_t>> by_device;
  for (size_t i = 0; i < shards.size(); ++i) by_device[shards[i]->device].push_back(i);
  std::vector<uint64_t> out(shards.size());
  for (const auto& [device, idx] : by_device) {
    std::vector<cuda::DeviceBlock> blocks;
    blocks.reserve(idx.size());
    for (size_t i : idx) {
      const trainer::ShardSource& s = *shards[i];
      blocks.push_back(cuda::DeviceBlock{s.name, s.dtype, s.global_shape, refit::Box{s.offset, s.local_shape}, s.data});
    }
    RC_ASSIGN_OR_RETURN(cuda::DeviceDigest digest, cuda::DeviceDigest::ForBlocks(blocks, device));
    RC_ASSIGN_OR_RETURN(std::vector<uint64_t> sums, digest.RunSlots());
    if (sums.size() != idx.size()) {
      return Internal(fmt::format("device {}: {} digests for {} shards", device, sums.size(), idx.size()));
    }
    for (size_t k = 0; k < idx.size(); ++k) out[idx[k]] = sums[k];
  }
  return out;
}
#endif

// The exception a Python signal handler raised during this thread's Publish (PublisherOptions::
// interrupted), for Publish to raise once the call returns.
thread_local std::shared_ptr<py::error_already_set> t_interrupt;

class PyPublisher {
 public:
  PyPublisher(std::string directory, std::string model, int32_t rank, int32_t world_size, const std::string& transport,
              int64_t lease_ttl_ms, int64_t keepalive_interval_ms, bool delta)
      : model_(std::move(model)), rank_(rank), world_size_(world_size) {
    if (world_size < 1) Raise(InvalidArgument(fmt::format("world_size must be >= 1, got {}", world_size)));
    if (rank < 0 || rank >= world_size) {
      Raise(InvalidArgument(fmt::format("rank {} is not a rank of world size {}", rank, world_size)));
    }
    Check(directory::ValidateName(model_, "Publisher: model"));
    // What the directory would refuse at the first publish, refused here.
    if (lease_ttl_ms < 1 || lease_ttl_ms > directory::kMaxLeaseTtlMs) {
      Raise(InvalidArgument(fmt::format("Publisher: lease_ttl_ms must be in [1, {}], got {}", directory::kMaxLeaseTtlMs,
                                        lease_ttl_ms)));
    }
    if (keepalive_interval_ms < 0 || keepalive_interval_ms >= lease_ttl_ms) {
      Raise(InvalidArgument(fmt::format("Publisher: keepalive_interval_ms must be in [0, lease_ttl_ms) (0: a third of "
                                        "the lease), got {} with lease_ttl_ms {}",
                                        keepalive_interval_ms, lease_ttl_ms)));
    }
    if (!net::IsHttpUrl(directory)) {
      Raise(InvalidArgument(fmt::format("Publisher: directory URL '{}' must be http:// or https://, a host and "
                                        "port, no path (e.g. http://127.0.0.1:7470)",
                                        directory)));
    }
    transport_ = Unwrap(transport::CreateTransport(transport));
    directory_ = std::make_unique<directory::DirectoryClient>(std::move(directory));
    trainer::PublisherOptions options;
    options.lease_ttl_ms = lease_ttl_ms;
    options.keepalive_interval_ms = keepalive_interval_ms;
    options.delta = delta;
#ifdef ROLLOUTCORE_WITH_CUDA
    // Device shards are digested at Publish, all of a version in one launch per device.
    options.device_digester = DigestShardsOnTheirGpus;
#endif
    // Ctrl-C during a lost publish's outcome inquiry (up to outcome_timeout_ms): the signal's
    // handler runs here (main thread only, as Python runs them), its exception is kept for
    // Publish to raise, and the inquiry ends with the version unresolved.
    options.interrupted = [] {
      py::gil_scoped_acquire gil;
      if (PyErr_CheckSignals() == 0) return false;
      t_interrupt = std::make_shared<py::error_already_set>();
      return true;
    };
    publisher_ =
        std::make_unique<trainer::Publisher>(transport_.get(), directory_.get(), model_, rank, world_size, options);
  }

  ~PyPublisher() {
    // Deregisters everything and drops the owners (they take the GIL, which the caller holds).
    publisher_.reset();
  }

  std::string transport_name() const { return std::string(transport_->name()); }

  void AddShard(const std::string& version, const std::string& name, const py::handle& array,
                const std::optional<refit::Shape>& offset, const std::optional<refit::Shape>& global_shape,
                const py::object& dtype) {
    const std::string what = fmt::format("tensor {} (rank {}, version {})", name, rank_, version);
    ArrayMemory mem = Unwrap(ReadArrayMemory(array, DTypeArg(dtype), what));
    // Device memory is named as such before the shm check, which would call it process memory.
    if (mem.device >= 0 && !transport_->capabilities().device_memory) {
      Raise(InvalidArgument(fmt::format("{}: the tensor is in CUDA device memory (device {}) and transport {} "
                                        "reads host memory only; pass copy=True (one device-to-host copy into "
                                        "shared memory) or publish with transport='cuda_ipc'",
                                        what, mem.device, transport_->name())));
    }
    if (transport_->name() == "shm" && !InsideSharedAllocation(mem.data, mem.bytes)) {
      Raise(InvalidArgument(fmt::format(
          "{}: the shm transport can only register shared memory, and this array is ordinary process memory. "
          "Allocate it with Publisher.allocate(shape, dtype) and write into it (zero copy), pass copy=True (one "
          "copy into shared memory), or use transport='ucx' (any host memory, zero copy)",
          what)));
    }
    trainer::ShardSource s;
    s.name = name;
    s.dtype = mem.dtype;
    s.local_shape = mem.shape;
    s.global_shape = global_shape.value_or(mem.shape);
    s.offset = offset.value_or(refit::Shape(mem.shape.size(), 0));
    s.data = mem.data;
    s.keep_alive = mem.owner;
    if (mem.device >= 0) {
#ifdef ROLLOUTCORE_WITH_CUDA
      // The digest is computed where the bytes live (no host copy of the model), at Publish, for
      // every device shard of the version at once (DigestShardsOnTheirGpus).
      s.memory_kind = transport::MemoryKind::kDevice;
      s.device = mem.device;
#else
      Raise(InvalidArgument(what + ": device memory needs a CUDA build of rolloutcore._core"));
#endif
    }
    ShardRecord rec;
    rec.name = name;
    rec.dtype = s.dtype;
    rec.global_shape = s.global_shape;
    rec.offset = s.offset;
    rec.local_shape = s.local_shape;
    rec.data = reinterpret_cast<uintptr_t>(mem.data);
    rec.bytes = mem.bytes;
    rec.source = mem.source;
    Check(publisher_->AddShard(version, std::move(s)));
    rc::MutexLock lock(mu_);
    records_[version].push_back(std::move(rec));
  }

  // probes_json: the refit JSON form of the probes (rolloutcore.probes.make_probes builds it).
  void AttachProbes(const std::string& version, const std::string& probes_json) {
    auto j = ParseJson(probes_json, "probes");
    if (!j.ok()) Raise(j.status());
    auto probes = refit::ProbesFromJson(*j);
    if (!probes.ok()) Raise(probes.status());
    Check(publisher_->AttachProbes(version, std::move(*probes)));
  }

  // A delta payload the caller encoded for a staged device shard (Publisher::AttachDeltaPayload):
  // `payload` is a 1-d uint8 array (a CUDA tensor for cuda_ipc), held until the version is released.
  void AttachDeltaPayload(const std::string& version, const std::string& name, const refit::Shape& offset,
                          const py::handle& payload, int64_t changed) {
    const std::string what = fmt::format("delta payload of tensor {} (rank {}, version {})", name, rank_, version);
    ArrayMemory mem = Unwrap(ReadArrayMemory(payload, refit::DType::kU8, what));
    trainer::DeltaPayloadSource d;
    d.tensor = name;
    d.offset = offset;
    d.data = mem.data;
    d.bytes = mem.bytes;
    d.memory_kind = mem.device >= 0 ? transport::MemoryKind::kDevice : transport::MemoryKind::kHost;
    d.device = mem.device;
    d.changed = changed;
    d.keep_alive = mem.owner;
    Check(publisher_->AttachDeltaPayload(version, std::move(d)));
  }

  // parts = [(tensor, offset, quantization, bytes digest, scales digest)].
  void AttachFp8Parts(const std::string& version, const py::list& parts) {
    std::vector<trainer::Fp8ShardPart> out;
    for (auto item : parts) {
      auto t = item.cast<std::tuple<std::string, std::vector<int64_t>, std::string, uint64_t, uint64_t>>();
      out.push_back(trainer::Fp8ShardPart{std::get<0>(t), std::get<1>(t), std::get<2>(t),
                                          refit::Fp8ImageDigest{std::get<3>(t), std::get<4>(t)}});
    }
    Check(publisher_->AttachFp8Parts(version, out));
  }

  py::dict Publish(const std::string& version, bool empty) {
    Result<trainer::PublishReport> report = InternalError();
    {
      py::gil_scoped_release nogil;
      report = empty ? publisher_->PublishEmpty(version) : publisher_->Publish(version);
    }
    if (t_interrupt) {
      // The exception a signal handler raised (KeyboardInterrupt for Ctrl-C), not the status.
      std::shared_ptr<py::error_already_set> e = std::move(t_interrupt);
      t_interrupt.reset();
      throw py::error_already_set(*e);
    }
    if (!report.ok()) Raise(report.status());
    py::dict tensors;
    std::map<std::string, uint64_t> sums;
    {
      rc::MutexLock lock(mu_);
      auto& recs = records_[version];
      for (const refit::ShardTable& t : report->tables) {
        for (const refit::ShardInfo& si : t.shards) {
          sums[t.name] += si.digest;
          for (ShardRecord& r : recs) {
            if (r.name == t.name && r.offset == si.offset) {
              r.handle = si.handle;
              r.digest = si.digest;
              r.published = true;
            }
          }
        }
      }
    }
    for (const auto& [name, d] : sums) tensors[py::str(name)] = Hex64(d);
    const directory::PublishResult& res = report->result;
    py::dict out;
    out["version"] = report->version;
    out["state"] = std::string(directory::VersionStateName(res.state));
    out["ranks_published"] = res.ranks_published;
    out["expected_ranks"] = res.expected_ranks;
    out["commit_seq"] = res.commit_seq;
    out["content_digest"] = Hex64(res.content_digest);
    out["lease_id"] = std::to_string(res.lease_id);
    out["shards"] = report->shards;
    out["bytes"] = report->bytes;
    out["register_ms"] = static_cast<double>(report->register_ns) / 1e6;
    out["digest_ms"] = static_cast<double>(report->digest_ns) / 1e6;
    out["publish_ms"] = static_cast<double>(report->publish_ns) / 1e6;
    out["delta_base"] = report->delta_base;
    out["delta_shards"] = report->delta_shards;
    out["delta_changed"] = report->delta_changed;
    out["delta_bytes"] = report->delta_bytes;
    out["tensor_digests"] = tensors;
    return out;
  }

  void Release(const std::string& version, bool in_directory) {
    Status s = publisher_->Release(version, in_directory);
    const std::vector<std::string> held = publisher_->versions();
    {
      rc::MutexLock lock(mu_);
      // A directory error still leaves the version dropped here (deregistered, arrays let go).
      if (std::find(held.begin(), held.end(), version) == held.end()) records_.erase(version);
    }
    Check(s);
  }

  py::list Shards(const std::string& version) const {
    rc::MutexLock lock(mu_);
    auto it = records_.find(version);
    if (it == records_.end()) {
      Raise(NotFound(fmt::format("rank {} holds no version {} of model {}", rank_, version, model_)));
    }
    py::list out;
    for (const ShardRecord& r : it->second) {
      py::dict d;
      d["name"] = r.name;
      d["dtype"] = std::string(refit::DTypeName(r.dtype));
      d["global_shape"] = ShapeList(r.global_shape);
      d["offset"] = ShapeList(r.offset);
      d["shape"] = ShapeList(r.local_shape);
      d["data_ptr"] = r.data;
      d["bytes"] = r.bytes;
      d["source"] = r.source;
      d["published"] = r.published;
      d["handle"] = r.handle;
      d["digest"] = r.published ? Hex64(r.digest) : std::string();
      out.append(d);
    }
    return out;
  }

  std::vector<std::string> Versions() const { return publisher_->versions(); }
  bool IsPublished(const std::string& version) const { return publisher_->IsPublished(version); }
  const std::string& model() const { return model_; }
  int32_t rank() const { return rank_; }
  int32_t world_size() const { return world_size_; }
  std::string lease_id() const { return std::to_string(publisher_->lease_id()); }

 private:
  static Status InternalError() { return Internal("publish did not run"); }

  const std::string model_;
  const int32_t rank_;
  const int32_t world_size_;
  // Destroyed in reverse order: the Publisher (which uses both) first.
  std::unique_ptr<transport::Transport> transport_;
  std::unique_ptr<directory::DirectoryClient> directory_;
  std::unique_ptr<trainer::Publisher> publisher_;
  mutable rc::Mutex mu_;
  std::map<std::string, std::vector<ShardRecord>> records_ GUARDED_BY(mu_);  // guarded by mu_
};

// ---- Planner ------------------------------------------------------------------------------------

py::dict StatsDict(int32_t rank, const refit::PlanStats& s, double capture_ms) {
  Json j = refit::PlanStatsToJson(s);
  j["rank"] = rank;
  j["capture_ms"] = capture_ms;
  return py::dict(py::module_::import("json").attr("loads")(j.dump()));
}

py::dict Plan(const std::string& model, const std::string& source, const std::string& target,
              std::optional<int32_t> rank, int64_t budget, std::optional<std::pair<int64_t, int64_t>> layers,
              std::vector<int64_t> experts, std::optional<std::string> only) {
  struct Line {
    int32_t rank;
    refit::PlanStats stats;
    double capture_ms;
  };
  refit::ModelConfig config;
  refit::TrainerLayout src;
  refit::EngineLayout dst;
  std::vector<Line> lines;
  Status status = OkStatus();
  {
    py::gil_scoped_release nogil;
    status = [&]() -> Status {
      RC_ASSIGN_OR_RETURN(config, refit::ResolveModelSpec(model));
      RC_ASSIGN_OR_RETURN(src, refit::ParseTrainerLayout(source));
      RC_ASSIGN_OR_RETURN(dst, refit::ParseEngineLayout(target));
      RC_RETURN_IF_ERROR(refit::CheckEngineLayout(config, dst));
      RC_ASSIGN_OR_RETURN(refit::Manifest manifest, refit::MakeTrainerManifest(config, src));
      refit::Selector selector;
      if (layers) {
        if (layers->first < 0 || layers->second < layers->first) {
          return InvalidArgument(
              fmt::format("layers ({}, {}): expected 0 <= first <= last", layers->first, layers->second));
        }
        selector.layers = *layers;
      }
      selector.experts = experts;
      if (only && !only->empty()) {
        const std::string needle = *only;
        selector.name_filter = [needle](std::string_view n) { return n.find(needle) != std::string_view::npos; };
      }
      std::vector<int32_t> ranks;
      if (rank) {
        if (*rank < 0 || *rank >= dst.world_size()) {
          return InvalidArgument(
              fmt::format("rank {}: engine layout {} has ranks 0..{}", *rank, dst.ToString(), dst.world_size() - 1));
        }
        ranks.push_back(*rank);
      } else {
        for (int32_t r = 0; r < dst.world_size(); ++r) ranks.push_back(r);
      }
      for (int32_t r : ranks) {
        const auto t0 = std::chrono::steady_clock::now();
        RC_ASSIGN_OR_RETURN(refit::Capture capture, refit::CaptureEngineRank(config, dst, r));
        const double capture_ms =
            std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
        refit::PlanOptions o;
        o.descriptor_budget = budget;
        o.selector = selector;
        o.dest_rank = r;
        const auto t1 = std::chrono::steady_clock::now();
        RC_ASSIGN_OR_RETURN(refit::TransferPlan plan, refit::BuildPlan(capture, manifest, o));
        plan.stats.plan_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t1).count();
        lines.push_back(Line{r, plan.stats, capture_ms});
      }
      return OkStatus();
    }();
  }
  Check(status);
  py::dict out;
  out["model"] = config.name;
  out["architecture"] = std::string(refit::ArchitectureName(config.architecture));
  out["parameters"] = config.num_parameters();
  out["source"] = src.ToString();
  out["target"] = dst.ToString();
  out["coverage"] = "ok";
  py::list ranks;
  uint64_t needed = 0, planned = 0, descriptors = 0, full_pulls = 0;
  for (const Line& l : lines) {
    ranks.append(StatsDict(l.rank, l.stats, l.capture_ms));
    needed += l.stats.bytes_needed;
    planned += l.stats.bytes_planned;
    descriptors += l.stats.descriptors;
    full_pulls += l.stats.full_pulls;
  }
  out["ranks"] = ranks;
  py::dict totals;
  totals["bytes_needed"] = needed;
  totals["bytes_planned"] = planned;
  totals["descriptors"] = descriptors;
  totals["full_pulls"] = full_pulls;
  out["totals"] = totals;
  return out;
}

py::list ModelTensors(const std::string& spec) {
  refit::ModelConfig config = Unwrap(refit::ResolveModelSpec(spec));
  std::vector<refit::TensorSpec> tensors = Unwrap(refit::ListSourceTensors(config));
  py::list out;
  for (const refit::TensorSpec& t : tensors) {
    py::dict d;
    d["name"] = t.name;
    d["dtype"] = std::string(refit::DTypeName(t.dtype));
    d["shape"] = ShapeList(t.shape);
    out.append(d);
  }
  return out;
}

py::list TrainerShards(const std::string& spec, const std::string& layout) {
  refit::ModelConfig config = Unwrap(refit::ResolveModelSpec(spec));
  refit::TrainerLayout l = Unwrap(refit::ParseTrainerLayout(layout));
  refit::Manifest m = Unwrap(refit::MakeTrainerManifest(config, l));
  py::list out;
  for (const refit::ShardTable& t : m.tables) {
    for (const refit::ShardInfo& s : t.shards) {
      py::dict d;
      d["name"] = t.name;
      d["dtype"] = std::string(refit::DTypeName(t.dtype));
      d["global_shape"] = ShapeList(t.shape);
      d["rank"] = s.rank;
      d["offset"] = ShapeList(s.offset);
      d["shape"] = ShapeList(s.shape);
      out.append(d);
    }
  }
  return out;
}

std::string TensorDigest(const py::handle& array, const std::optional<refit::Shape>& global_shape,
                         const std::optional<refit::Shape>& offset, const py::object& dtype) {
  ArrayMemory mem = Unwrap(ReadArrayMemory(array, DTypeArg(dtype), "tensor_digest"));
  const refit::Shape shape = global_shape.value_or(mem.shape);
  const refit::Box box{offset.value_or(refit::Shape(mem.shape.size(), 0)), mem.shape};
  Check(refit::ValidateShape(shape, "tensor_digest: global_shape"));
  if (box.start.size() != shape.size() || mem.shape.size() != shape.size() ||
      !refit::Contains(refit::FullBox(shape), box)) {
    Raise(InvalidArgument(fmt::format("tensor_digest: box {} lies outside the tensor's shape {}",
                                      refit::BoxToString(box), refit::ShapeToString(shape))));
  }
  return Hex64(refit::DigestBlock(mem.dtype, shape, box, mem.data));
}

std::string CombineDigests(const py::dict& digests) {
  refit::TensorDigests d;
  for (auto [k, v] : digests) {
    const std::string name = py::str(k).cast<std::string>();
    d[name] = ParseDigest(v, name);
  }
  return Hex64(refit::CombineTensorDigests(d));
}

py::list Transports() {
  py::list out;
  for (const transport::BackendEntry& e : transport::RegisteredBackends()) {
    py::dict d;
    d["name"] = std::string(e.name);
    d["description"] = std::string(e.description);
    out.append(d);
  }
  return out;
}

}  // namespace
}  // namespace rc::python

PYBIND11_MODULE(_core, m) {
  namespace py = pybind11;
  using rc::python::PyPublisher;
  m.doc() = "rolloutcore's compiled core: the trainer Publisher, shared memory, planner statistics, digests.";
  // pybind11 (2.10, Debian 12) sets up its numpy API in a function-local static on first use,
  // importing numpy while it holds the static's guard: the first py::array calls from several
  // threads at once deadlocked (one holds the guard and waits for the GIL, another holds the GIL
  // and waits for the guard). Set up here, once, at import.
  py::detail::npy_api::get();

  py::class_<PyPublisher>(m, "Publisher")
      .def(py::init<std::string, std::string, int32_t, int32_t, std::string, int64_t, int64_t, bool>(),
           py::arg("directory"), py::arg("model"), py::arg("rank") = 0, py::arg("world_size") = 1,
           py::arg("transport") = "shm", py::arg("lease_ttl_ms") = 30000, py::arg("keepalive_interval_ms") = 0,
           py::arg("delta") = false)
      .def("add_shard", &PyPublisher::AddShard, py::arg("version"), py::arg("name"), py::arg("array"),
           py::arg("offset") = py::none(), py::arg("global_shape") = py::none(), py::arg("dtype") = py::none())
      .def(
          "publish", [](PyPublisher& p, const std::string& v) { return p.Publish(v, false); }, py::arg("version"))
      .def(
          "publish_empty", [](PyPublisher& p, const std::string& v) { return p.Publish(v, true); }, py::arg("version"))
      .def("attach_probes", &PyPublisher::AttachProbes, py::arg("version"), py::arg("probes_json"))
      .def("attach_fp8_parts", &PyPublisher::AttachFp8Parts, py::arg("version"), py::arg("parts"))
      .def("attach_delta_payload", &PyPublisher::AttachDeltaPayload, py::arg("version"), py::arg("name"),
           py::arg("offset"), py::arg("payload"), py::arg("changed"))
      .def("release", &PyPublisher::Release, py::arg("version"), py::arg("in_directory") = true)
      .def("shards", &PyPublisher::Shards, py::arg("version"))
      .def("versions", &PyPublisher::Versions)
      .def("is_published", &PyPublisher::IsPublished, py::arg("version"))
      .def_property_readonly("model", &PyPublisher::model)
      .def_property_readonly("rank", &PyPublisher::rank)
      .def_property_readonly("world_size", &PyPublisher::world_size)
      .def_property_readonly("transport", &PyPublisher::transport_name)
      .def_property_readonly("lease_id", &PyPublisher::lease_id);

  m.def(
      "allocate",
      [](const rc::refit::Shape& shape, const py::object& dtype) {
        auto d = rc::python::DTypeArg(dtype);
        if (!d) rc::python::Raise(rc::InvalidArgument("allocate: dtype is required"));
        return rc::python::Unwrap(rc::python::Allocate(shape, *d));
      },
      py::arg("shape"), py::arg("dtype"));
  m.def("shared_allocations", &rc::python::SharedAllocationStats);
  m.def("plan", &rc::python::Plan, py::arg("model"), py::arg("source"), py::arg("target"), py::arg("rank") = py::none(),
        py::arg("budget") = 64, py::arg("layers") = py::none(), py::arg("experts") = std::vector<int64_t>{},
        py::arg("only") = py::none());
  m.def("model_tensors", &rc::python::ModelTensors, py::arg("model"));
  m.def("trainer_shards", &rc::python::TrainerShards, py::arg("model"), py::arg("layout"));
  m.def("tensor_digest", &rc::python::TensorDigest, py::arg("array"), py::arg("global_shape") = py::none(),
        py::arg("offset") = py::none(), py::arg("dtype") = py::none());
  m.def("combine_digests", &rc::python::CombineDigests, py::arg("digests"));
  // refit::EncodeShardDeltaFromChanges: the delta payload (bytes) of a shard of `dtype` and
  // `shape` from its changed row-major offsets (int64, increasing) and their new values' bytes.
  m.def(
      "encode_delta_from_changes",
      [](const std::string& dtype, const rc::refit::Shape& shape,
         const py::array_t<int64_t, py::array::c_style | py::array::forcecast>& offsets,
         const py::array_t<uint8_t, py::array::c_style | py::array::forcecast>& values) {
        auto d = rc::refit::ParseDType(dtype);
        if (!d.ok()) rc::python::Raise(d.status());
        rc::Result<rc::refit::EncodedDelta> e = rc::Internal("encode did not run");
        {
          py::gil_scoped_release nogil;
          e = rc::refit::EncodeShardDeltaFromChanges(
              *d, shape, std::span<const int64_t>(offsets.data(), static_cast<size_t>(offsets.size())),
              std::span<const std::byte>(reinterpret_cast<const std::byte*>(values.data()),
                                         static_cast<size_t>(values.size())));
        }
        if (!e.ok()) rc::python::Raise(e.status());
        // A copy of the bytes (no base object: the array owns its memory).
        py::array_t<uint8_t> out(std::vector<py::ssize_t>{static_cast<py::ssize_t>(e->bytes.size())},
                                 reinterpret_cast<const uint8_t*>(e->bytes.data()));
        return py::make_tuple(out, e->changed);
      },
      py::arg("dtype"), py::arg("shape"), py::arg("offsets"), py::arg("values"));
  m.def("transports", &rc::python::Transports);
  rc::python::RegisterFp8(m);
#ifdef ROLLOUTCORE_WITH_CUDA
  m.attr("cuda_built") = true;
  rc::python::RegisterDeviceStager(m);
#else
  m.attr("cuda_built") = false;
#endif
}
