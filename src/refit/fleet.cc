#include "rolloutcore/refit/fleet.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <numeric>
#include <sstream>

namespace rc::refit {
namespace {

std::string_view Trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t' || s.front() == '\r')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r')) s.remove_suffix(1);
  return s;
}

std::vector<std::string_view> Words(std::string_view s) {
  std::vector<std::string_view> w;
  size_t i = 0;
  while (i < s.size()) {
    while (i < s.size() && (s[i] == ' ' || s[i] == '\t')) ++i;
    size_t j = i;
    while (j < s.size() && s[j] != ' ' && s[j] != '\t') ++j;
    if (j > i) w.push_back(s.substr(i, j - i));
    i = j;
  }
  return w;
}

bool ParseInt(std::string_view s, int32_t* out, int32_t lo, int32_t hi) {
  int32_t v = 0;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || p != s.data() + s.size() || v < lo || v > hi) return false;
  *out = v;
  return true;
}

bool ParseLinks(std::string_view s, NodeLinks* out) {
  const size_t x = s.find('x');
  if (x == std::string_view::npos) return false;
  NodeLinks l;
  if (!ParseInt(s.substr(0, x), &l.count, 1, 1024)) return false;
  const std::string gbps(s.substr(x + 1));
  try {
    size_t used = 0;
    l.gbps = std::stod(gbps, &used);
    if (used != gbps.size() || !(l.gbps > 0) || l.gbps > 1e6) return false;
  } catch (const std::exception&) {
    return false;
  }
  *out = l;
  return true;
}

const NodeLinks& LinksOf(const std::map<int32_t, NodeLinks>& overrides, const NodeLinks& def, int32_t node) {
  auto it = overrides.find(node);
  return it == overrides.end() ? def : it->second;
}

}  // namespace

std::string NodeLinksToString(const NodeLinks& l) { return fmt::format("{}x{:g}", l.count, l.gbps); }

Result<FleetLinks> ParseFleetLinks(std::string_view text, std::string_view what) {
  FleetLinks f;
  int line_no = 0;
  size_t pos = 0;
  while (pos <= text.size()) {
    size_t end = text.find('\n', pos);
    if (end == std::string_view::npos) end = text.size();
    std::string_view line = text.substr(pos, end - pos);
    pos = end + 1;
    ++line_no;
    if (const size_t hash = line.find('#'); hash != std::string_view::npos) line = line.substr(0, hash);
    line = Trim(line);
    if (line.empty()) {
      if (end == text.size()) break;
      continue;
    }
    const auto w = Words(line);
    auto bad = [&](std::string_view why) {
      return InvalidArgument(fmt::format("{} line {}: '{}': {}", what, line_no, line, why));
    };
    if (w[0] == "gpus_per_node") {
      if (w.size() != 2 || !ParseInt(w[1], &f.gpus_per_node, 1, 1024)) return bad("expected gpus_per_node N (1..1024)");
    } else if (w[0] == "trainer" || w[0] == "engine") {
      NodeLinks l;
      if (w.size() != 2 || !ParseLinks(w[1], &l)) return bad("expected trainer|engine COUNTxGBPS, e.g. 8x400");
      (w[0] == "trainer" ? f.trainer : f.engine) = l;
    } else if (w[0] == "trainer_node" || w[0] == "engine_node") {
      int32_t node = 0;
      NodeLinks l;
      if (w.size() != 3 || !ParseInt(w[1], &node, 0, 1 << 20) || !ParseLinks(w[2], &l)) {
        return bad("expected trainer_node|engine_node NODE COUNTxGBPS");
      }
      (w[0] == "trainer_node" ? f.trainer_nodes : f.engine_nodes)[node] = l;
    } else {
      return bad("unknown setting (gpus_per_node, trainer, engine, trainer_node, engine_node)");
    }
    if (end == text.size()) break;
  }
  return f;
}

Result<std::pair<int32_t, EngineLayout>> ParseFleetEngines(std::string_view text) {
  int32_t replicas = 1;
  std::string_view layout = text;
  if (const size_t x = text.find('x'); x != std::string_view::npos && x < text.find(':')) {
    if (!ParseInt(text.substr(0, x), &replicas, 1, 1 << 20)) {
      return InvalidArgument(
          fmt::format("--engines '{}': expected REPLICASxLAYOUT, e.g. 128xtp:8, with 1..2^20 "
                      "replicas",
                      text));
    }
    layout = text.substr(x + 1);
  }
  auto l = ParseEngineLayout(layout);
  if (!l.ok()) return l.status().WithContext(fmt::format("--engines '{}'", text));
  return std::pair<int32_t, EngineLayout>{replicas, *l};
}

Result<FleetReport> PlanFleet(const FleetSpec& spec) {
  RC_RETURN_IF_ERROR(CheckEngineLayout(spec.model, spec.engine));
  if (spec.replicas < 1) return InvalidArgument(fmt::format("fleet: {} engine replicas (need >= 1)", spec.replicas));
  if (static_cast<int64_t>(spec.replicas) * spec.engine.world_size() > INT32_MAX) {
    return InvalidArgument(
        fmt::format("fleet: {} replicas of {} ranks exceed 2^31 receivers", spec.replicas, spec.engine.world_size()));
  }
  RC_ASSIGN_OR_RETURN(Manifest manifest, MakeTrainerManifest(spec.model, spec.trainer, "fleet"));
  auto now_ns = [&]() -> int64_t { return spec.clock != nullptr ? spec.clock->NowNs() : 0; };
  FleetReport rep;
  rep.trainer_ranks = spec.trainer.ranks;
  rep.engine_world = spec.engine.world_size();
  rep.receivers = static_cast<int64_t>(spec.replicas) * rep.engine_world;
  rep.source_bytes.assign(static_cast<size_t>(rep.trainer_ranks), 0);
  rep.source_descriptors.assign(static_cast<size_t>(rep.trainer_ranks), 0);
  rep.receiver_bytes.assign(static_cast<size_t>(rep.receivers), 0);
  rep.receiver_descriptors.assign(static_cast<size_t>(rep.receivers), 0);

  // Model bytes and the rotation period L = lcm of the replica counts of every distinct box.
  int64_t period = 1;
  for (const ShardTable& t : manifest.tables) {
    rep.model_bytes += t.spec().bytes();
    if (t.shards.size() < 2) continue;
    // Fast path (fsdp, tp splits): shards in strictly increasing order of their start are distinct.
    bool increasing = true;
    for (size_t i = 1; i < t.shards.size() && increasing; ++i) increasing = t.shards[i - 1].offset < t.shards[i].offset;
    if (increasing) continue;
    std::vector<uint32_t> order(t.shards.size());
    std::iota(order.begin(), order.end(), 0u);
    auto key = [&](uint32_t i) { return std::tie(t.shards[i].offset, t.shards[i].shape); };
    std::sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) { return key(a) < key(b); });
    for (size_t i = 0; i < order.size();) {
      size_t j = i + 1;
      while (j < order.size() && key(order[j]) == key(order[i])) ++j;
      const auto count = static_cast<int64_t>(j - i);
      if (count > 1 && period <= rep.receivers) period = std::lcm(period, count);
      i = j;
    }
  }
  const bool fold = !spec.plan_every_receiver && period < rep.receivers;
  rep.rotation_period = fold ? period : rep.receivers;

  for (int32_t r = 0; r < rep.engine_world; ++r) {
    const int64_t t0 = now_ns();
    RC_ASSIGN_OR_RETURN(Capture capture, CaptureEngineRank(spec.model, spec.engine, r));
    const double capture_ms = static_cast<double>(now_ns() - t0) / 1e6;
    rep.capture_ms_total += capture_ms;
    // Receivers of this engine rank, grouped by class key (g mod L, or g itself).
    std::map<int64_t, std::vector<int64_t>> groups;
    for (int64_t replica = 0; replica < spec.replicas; ++replica) {
      const int64_t g = replica * rep.engine_world + r;
      groups[fold ? g % period : g].push_back(g);
    }
    for (const auto& [rotation, members] : groups) {
      PlanOptions o;
      o.descriptor_budget = spec.descriptor_budget;
      o.dest_rank = static_cast<int32_t>(members.front());
      const int64_t t1 = now_ns();
      auto plan = BuildPlan(capture, manifest, o);
      if (plan.ok()) plan->stats.plan_ms = static_cast<double>(now_ns() - t1) / 1e6;
      if (!plan.ok()) {
        return plan.status().WithContext(
            fmt::format("fleet: plan of engine rank {} (receiver {})", r, members.front()));
      }
      const auto n = static_cast<uint64_t>(members.size());
      FleetPlanClass c{r, rotation, static_cast<int64_t>(members.size()), plan->stats, capture_ms};
      rep.plan_ms_total += plan->stats.plan_ms;
      rep.plan_ms_max = std::max(rep.plan_ms_max, plan->stats.plan_ms);
      for (const ReadRun& run : plan->runs) {
        const auto src = static_cast<size_t>(plan->sources[run.source].rank);
        rep.source_bytes[src] += run.length * n;
        rep.source_descriptors[src] += n;
      }
      for (int64_t g : members) {
        rep.receiver_bytes[static_cast<size_t>(g)] = plan->stats.bytes_planned;
        rep.receiver_descriptors[static_cast<size_t>(g)] = plan->stats.descriptors;
      }
      rep.total_bytes += plan->stats.bytes_planned * n;
      rep.total_descriptors += plan->stats.descriptors * n;
      rep.classes.push_back(std::move(c));
    }
  }

  // Links.
  const int32_t gpn = spec.links.gpus_per_node;
  auto add_side = [&](bool trainer, const std::vector<uint64_t>& per_gpu) {
    const int64_t gpus = static_cast<int64_t>(per_gpu.size());
    const int64_t nodes = (gpus + gpn - 1) / gpn;
    for (int64_t node = 0; node < nodes; ++node) {
      const NodeLinks& nl = LinksOf(trainer ? spec.links.trainer_nodes : spec.links.engine_nodes,
                                    trainer ? spec.links.trainer : spec.links.engine, static_cast<int32_t>(node));
      const size_t first = rep.links.size();
      for (int32_t k = 0; k < nl.count; ++k) {
        rep.links.push_back(LinkLoad{trainer, static_cast<int32_t>(node), k, nl.gbps, 0});
      }
      for (int64_t i = 0; i < gpn && node * gpn + i < gpus; ++i) {
        const int64_t link = i * nl.count / gpn;
        rep.links[first + static_cast<size_t>(link)].bytes += per_gpu[static_cast<size_t>(node * gpn + i)];
      }
    }
  };
  add_side(true, rep.source_bytes);
  add_side(false, rep.receiver_bytes);
  for (const LinkLoad& l : rep.links) {
    if (l.seconds() > rep.lower_bound_s) {
      rep.lower_bound_s = l.seconds();
      rep.bottleneck = l;
    }
  }
  return rep;
}

}  // namespace rc::refit
