#include "rolloutcore/trainer/fp8_parts.h"

#include <algorithm>
#include <chrono>
#include <span>

#include <fmt/format.h>

#include "rolloutcore/formats/fp8.h"
#include "rolloutcore/refit/digest.h"

namespace rc::trainer {
namespace {

// What the shards say about the FP8 parameters they touch.
struct Plan {
  formats::Fp8Scheme scheme = formats::Fp8Scheme::kPerTensor;
  std::map<std::string, refit::Fp8Param, std::less<>> params;
  // Per shard: its parameter ("": served in bf16) and its box in the parameter's coordinates.
  // (Names, not pointers into `params`: a Plan is moved and copied.)
  std::vector<std::string> param_of;
  std::vector<formats::Fp8Box> box;
  const refit::Fp8Param* ParamOf(size_t shard) const {
    return param_of[shard].empty() ? nullptr : &params.at(param_of[shard]);
  }
};

formats::Fp8Layout LayoutOf(const Plan& plan, const refit::Fp8Param& p) {
  return formats::Fp8Layout{plan.scheme, p.shape[0], p.shape[1]};
}

Result<Plan> MakePlan(const std::vector<Fp8ShardInput>& shards, std::string_view quantization,
                      const std::vector<refit::TensorSpec>& model) {
  Plan plan;
  auto scheme = formats::Fp8SchemeFromVllmQuantization(quantization);
  if (!scheme.ok()) return scheme.status();
  plan.scheme = *scheme;
  std::vector<refit::TensorSpec> specs;
  for (const refit::TensorSpec& m : model) {
    for (const Fp8ShardInput& s : shards) {
      if (s.name == m.name && (s.dtype != m.dtype || s.global_shape != m.shape)) {
        return InvalidArgument(fmt::format("tensor {}: the shard says {} {}, the model says {} {}", s.name,
                                           refit::DTypeName(s.dtype), refit::ShapeToString(s.global_shape),
                                           refit::DTypeName(m.dtype), refit::ShapeToString(m.shape)));
      }
    }
    if (refit::Fp8ParameterOf(m.name)) specs.push_back(m);
  }
  for (const Fp8ShardInput& s : shards) {
    const bool seen = std::any_of(specs.begin(), specs.end(), [&](const refit::TensorSpec& t) { return t.name == s.name; });
    if (!seen) specs.push_back(refit::TensorSpec{s.name, s.dtype, s.global_shape});
  }
  auto params = refit::Fp8Parameters(specs);
  if (!params.ok()) {
    if (params.status().message().find("is missing beside") == std::string_view::npos) return params.status();
    return InvalidArgument(std::string(params.status().message()) +
                           ": this rank holds no shard of that part, so it cannot place the others; give the "
                           "model's tensors (PublisherOptions::fp8_model, Python publish(fp8_model=...))");
  }
  plan.params = std::move(params).value();
  for (const Fp8ShardInput& s : shards) {
    const auto of = refit::Fp8ParameterOf(s.name);
    const refit::Fp8Param* p = of ? &plan.params.at(of->param) : nullptr;
    plan.param_of.push_back(of ? of->param : std::string());
    formats::Fp8Box b;
    if (p != nullptr) {
      if (s.data == nullptr) return InvalidArgument(fmt::format("tensor {}: shard {} has no data", s.name, refit::BoxToString(s.box)));
      const refit::Fp8Param::Part* part = p->Find(s.name);
      b = formats::Fp8Box{part->row0 + s.box.start[0], s.box.start[1], s.box.extent[0], s.box.extent[1]};
    }
    plan.box.push_back(b);
  }
  return plan;
}

// The extent of one scale group: {rows, columns}.
std::pair<int64_t, int64_t> GroupExtent(const formats::Fp8Layout& l) {
  switch (l.scheme) {
    case formats::Fp8Scheme::kBlock: return {l.block_rows, l.block_cols};
    case formats::Fp8Scheme::kPerChannel: return {1, std::max<int64_t>(l.cols, 1)};
    case formats::Fp8Scheme::kPerTensor: break;
  }
  return {std::max<int64_t>(l.rows, 1), std::max<int64_t>(l.cols, 1)};
}

// [lo, hi) of the groups along one axis whose first element lies in [a, b), groups of `size`.
std::pair<int64_t, int64_t> OwnedRange(int64_t a, int64_t b, int64_t size) {
  return {(a + size - 1) / size, (b + size - 1) / size};
}

// The box of the scale grid a parameter box owns (the groups whose first element lies in it).
refit::Box OwnedScales(const formats::Fp8Layout& l, const formats::Fp8Box& b) {
  const auto [block_rows, block_cols] = GroupExtent(l);
  auto [r0, r1] = OwnedRange(b.row0, b.row0 + b.rows, block_rows);
  auto [c0, c1] = OwnedRange(b.col0, b.col0 + b.cols, block_cols);
  return refit::Box{{r0, c0}, {std::max<int64_t>(0, r1 - r0), std::max<int64_t>(0, c1 - c0)}};
}

}  // namespace

Result<Fp8Amax> Fp8LocalAmax(const std::vector<Fp8ShardInput>& shards, std::string_view quantization,
                             std::string* partial, int threads, const std::vector<refit::TensorSpec>& model) {
  RC_ASSIGN_OR_RETURN(Plan plan, MakePlan(shards, quantization, model));
  Fp8Amax amax;
  std::map<std::string, std::vector<int64_t>, std::less<>> held;  // elements held per group
  for (size_t i = 0; i < shards.size(); ++i) {
    const refit::Fp8Param* p = plan.ParamOf(i);
    if (p == nullptr) continue;
    const formats::Fp8Layout l = LayoutOf(plan, *p);
    auto& a = amax[p->name];
    auto& h = held[p->name];
    if (a.empty()) {
      a.assign(static_cast<size_t>(l.NumScales()), 0);
      h.assign(static_cast<size_t>(l.NumScales()), 0);
    }
    const formats::Fp8Box& b = plan.box[i];
    const std::span<const uint16_t> bf16(static_cast<const uint16_t*>(shards[i].data),
                                         static_cast<size_t>(b.rows * b.cols));
    RC_RETURN_IF_ERROR(formats::Fp8BoxAmax(bf16, l, b, a, shards[i].name, threads));
    if (partial != nullptr) {
      // Elements of each group this box holds: per row of the box, the columns of each group.
      const int64_t bc = GroupExtent(l).second;
      for (int64_t r = b.row0; r < b.row0 + b.rows; ++r) {
        for (int64_t c = b.col0; c < b.col0 + b.cols;) {
          const int64_t end = std::min(b.col0 + b.cols, (c / bc + 1) * bc);
          h[static_cast<size_t>(l.GroupOf(r, c))] += end - c;
          c = end;
        }
      }
    }
  }
  if (partial != nullptr) {
    partial->clear();
    for (const auto& [name, h] : held) {
      const refit::Fp8Param& p = plan.params.at(name);
      const formats::Fp8Layout l = LayoutOf(plan, p);
      const auto grid = l.ScaleGrid();
      for (size_t g = 0; g < h.size() && partial->empty(); ++g) {
        if (h[g] == 0) continue;
        const int64_t gr = static_cast<int64_t>(g) / grid[1], gc = static_cast<int64_t>(g) % grid[1];
        const auto [rows, cols] = GroupExtent(l);
        const int64_t r0 = gr * rows, c0 = gc * cols;
        const int64_t r1 = std::min(l.rows, r0 + rows), c1 = std::min(l.cols, c0 + cols);
        const int64_t size = (r1 - r0) * (c1 - c0);
        if (h[g] < size) {
          *partial = fmt::format("FP8 parameter {}: the {} scale group of rows {}..{}, columns {}..{} is held here "
                                 "only in part ({} of {} elements)",
                                 name, quantization, r0, r1, c0, c1, h[g], size);
        }
      }
    }
  }
  return amax;
}

Result<std::vector<std::optional<refit::Fp8ImageDigest>>> Fp8PartsFromAmax(const std::vector<Fp8ShardInput>& shards,
                                                                          std::string_view quantization,
                                                                          const Fp8Amax& merged, int threads,
                                                                          const std::vector<refit::TensorSpec>& model) {
  RC_ASSIGN_OR_RETURN(Plan plan, MakePlan(shards, quantization, model));
  std::map<std::string, std::vector<float>, std::less<>> scales;
  std::vector<std::optional<refit::Fp8ImageDigest>> out(shards.size());
  std::vector<uint8_t> q;
  std::vector<float> owned;
  for (size_t i = 0; i < shards.size(); ++i) {
    const refit::Fp8Param* p = plan.ParamOf(i);
    if (p == nullptr) continue;
    const formats::Fp8Layout l = LayoutOf(plan, *p);
    auto it = scales.find(p->name);
    if (it == scales.end()) {
      auto a = merged.find(p->name);
      if (a == merged.end() || static_cast<int64_t>(a->second.size()) != l.NumScales()) {
        return InvalidArgument(fmt::format("FP8 parameter {}: the merged amax has {} groups, its {} scale grid {}",
                                           p->name, a == merged.end() ? 0 : a->second.size(), quantization,
                                           l.NumScales()));
      }
      std::vector<float> s(static_cast<size_t>(l.NumScales()));
      formats::Fp8ScalesFromAmax(l, a->second, s);
      it = scales.emplace(p->name, std::move(s)).first;
    }
    const formats::Fp8Box& b = plan.box[i];
    const std::span<const uint16_t> bf16(static_cast<const uint16_t*>(shards[i].data),
                                         static_cast<size_t>(b.rows * b.cols));
    q.resize(static_cast<size_t>(b.rows * b.cols));
    RC_RETURN_IF_ERROR(formats::QuantizeBf16BoxToFp8(bf16, l, b, it->second, q, shards[i].name, threads));
    const auto g = l.ScaleGrid();
    const refit::Shape grid{g[0], g[1]};
    const refit::Box sbox = OwnedScales(l, b);
    owned.clear();
    for (int64_t r = sbox.start[0]; r < sbox.start[0] + sbox.extent[0]; ++r) {
      for (int64_t c = sbox.start[1]; c < sbox.start[1] + sbox.extent[1]; ++c) {
        owned.push_back(it->second[static_cast<size_t>(r * g[1] + c)]);
      }
    }
    const refit::Box qbox{{b.row0, b.col0}, {b.rows, b.cols}};
    out[i] = refit::Fp8ImagePart(p->shape, qbox, q.data(), grid, sbox, owned.data());
  }
  return out;
}

Result<std::vector<std::optional<refit::Fp8ImageDigest>>> Fp8ShardParts(const std::vector<Fp8ShardInput>& shards,
                                                                       std::string_view quantization,
                                                                       const Fp8AmaxExchange& exchange, int threads,
                                                                       const std::vector<refit::TensorSpec>& model) {
  std::string partial;
  RC_ASSIGN_OR_RETURN(Fp8Amax amax,
                      Fp8LocalAmax(shards, quantization, exchange ? nullptr : &partial, threads, model));
  if (exchange) {
    RC_RETURN_IF_ERROR(exchange(quantization, &amax));
  } else if (!partial.empty()) {
    return FailedPrecondition(partial + ": its scale needs the amax of every rank that holds the rest; pass an amax "
                                        "exchange (an all-reduce MAX over the trainer's ranks)");
  }
  return Fp8PartsFromAmax(shards, quantization, amax, threads, model);
}

Fp8AmaxExchange Fp8ThreadExchange::Bind() {
  return [this](std::string_view quantization, Fp8Amax* amax) { return Exchange(quantization, amax); };
}

Status Fp8ThreadExchange::Exchange(std::string_view quantization, Fp8Amax* amax) {
  rc::MutexLock lock(mu_);
  const uint64_t round = round_;
  for (const auto& [name, v] : *amax) {
    auto& m = merged_[name];
    if (m.empty()) m.assign(v.size(), 0);
    if (m.size() != v.size()) {
      return InvalidArgument(fmt::format("FP8 amax exchange ({}): parameter {} has {} groups here, {} on another rank",
                                         quantization, name, v.size(), m.size()));
    }
    formats::Fp8MergeAmax(v, m);
  }
  if (++arrived_ == ranks_) {
    result_ = std::move(merged_);
    merged_.clear();
    arrived_ = 0;
    ++round_;
    cv_.notify_all();
  } else {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms_);
    while (round_ == round && failed_round_ != round) {
      if (cv_.wait_until(lock, deadline) == std::cv_status::timeout && round_ == round && failed_round_ != round) {
        const int joined = arrived_;
        failed_round_ = round;  // the others of this round fail too
        merged_.clear();
        arrived_ = 0;
        ++round_;
        cv_.notify_all();
        return DeadlineExceeded(fmt::format("FP8 amax exchange ({}): {} of {} ranks joined within {} ms", quantization,
                                            joined, ranks_, timeout_ms_));
      }
    }
    if (failed_round_ == round) {
      return DeadlineExceeded(fmt::format("FP8 amax exchange ({}): the round failed (a rank did not join within {} ms)",
                                          quantization, timeout_ms_));
    }
  }
  for (auto& [name, v] : *amax) v = result_.at(name);
  return OkStatus();
}

}  // namespace rc::trainer
