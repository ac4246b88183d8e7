#include "rolloutcore/refit/layouts.h"

#include <fmt/format.h>

#include <charconv>

namespace rc::refit {
namespace {

std::string L(int64_t layer, std::string_view suffix) { return fmt::format("model.layers.{}.{}", layer, suffix); }
std::string E(int64_t layer, int64_t expert, std::string_view proj) {
  return fmt::format("model.layers.{}.mlp.experts.{}.{}.weight", layer, expert, proj);
}

Result<int32_t> ParseCount(std::string_view text, std::string_view what) {
  int32_t v = 0;
  auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || ptr != text.data() + text.size() || v < 1 || v > 65536) {
    return InvalidArgument(fmt::format("{}: expected a rank count in 1..65536, got '{}'", what, text));
  }
  return v;
}

bool EndsWith(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

}  // namespace

// ---- Layout parsing -----------------------------------------------------------------------------

std::string TrainerLayout::ToString() const {
  switch (kind) {
    case Kind::kFsdp: return fmt::format("fsdp:{}", ranks);
    case Kind::kTp: return fmt::format("tp:{}", ranks);
    case Kind::kReplicated: return ranks == 1 ? "replicated" : fmt::format("replicated:{}", ranks);
  }
  return "?";
}

Result<TrainerLayout> ParseTrainerLayout(std::string_view text) {
  const std::string what = fmt::format("trainer layout '{}'", text);
  TrainerLayout l;
  if (text == "replicated") return l;
  const size_t colon = text.find(':');
  if (colon == std::string_view::npos) {
    return InvalidArgument(what + ": expected fsdp:N, tp:N or replicated[:N]");
  }
  const std::string_view kind = text.substr(0, colon);
  RC_ASSIGN_OR_RETURN(l.ranks, ParseCount(text.substr(colon + 1), what));
  if (kind == "fsdp") l.kind = TrainerLayout::Kind::kFsdp;
  else if (kind == "tp") l.kind = TrainerLayout::Kind::kTp;
  else if (kind == "replicated") l.kind = TrainerLayout::Kind::kReplicated;
  else return InvalidArgument(what + ": expected fsdp:N, tp:N or replicated[:N]");
  return l;
}

std::string EngineLayout::ToString() const {
  std::string s;
  if (tp > 1 || ep == 1) s = fmt::format("tp:{}", tp);
  if (ep > 1) s += fmt::format("{}ep:{}", s.empty() ? "" : "+", ep);
  if (param_dtype != DType::kF32) s += fmt::format("@{}", DTypeName(param_dtype));
  return s;
}

Result<EngineLayout> ParseEngineLayout(std::string_view text) {
  const std::string what = fmt::format("engine layout '{}'", text);
  EngineLayout l;
  std::string_view body = text;
  if (const size_t at = text.find('@'); at != std::string_view::npos) {
    auto d = ParseDType(text.substr(at + 1));
    if (!d.ok()) return d.status().WithContext(what);
    l.param_dtype = *d;
    body = text.substr(0, at);
  }
  bool have_tp = false, have_ep = false;
  while (!body.empty()) {
    const size_t sep = body.find_first_of("+,");
    const std::string_view part = body.substr(0, sep);
    body = sep == std::string_view::npos ? std::string_view() : body.substr(sep + 1);
    const size_t colon = part.find(':');
    const std::string_view kind = part.substr(0, colon);
    if (colon == std::string_view::npos || (kind != "tp" && kind != "ep")) {
      return InvalidArgument(what + ": expected tp:N, ep:M or tp:N+ep:M, optionally @dtype");
    }
    RC_ASSIGN_OR_RETURN(int32_t n, ParseCount(part.substr(colon + 1), what));
    if (kind == "tp") {
      l.tp = n;
      have_tp = true;
    } else {
      l.ep = n;
      have_ep = true;
    }
  }
  if (!have_tp && !have_ep) return InvalidArgument(what + ": expected tp:N, ep:M or tp:N+ep:M");
  if (have_tp && have_ep && l.tp != l.ep && l.ep != 1) {
    return InvalidArgument(fmt::format("{}: ep:{} must equal tp:{} (experts are spread over the same ranks)", what,
                                       l.ep, l.tp));
  }
  return l;
}

// ---- Source tensors and trainer manifests -------------------------------------------------------

Result<std::vector<TensorSpec>> ListSourceTensors(const ModelConfig& c) {
  RC_RETURN_IF_ERROR(ValidateModelConfig(c));
  const DType dt = c.dtype;
  const int64_t h = c.hidden_size;
  std::vector<TensorSpec> t;
  t.push_back({"model.embed_tokens.weight", dt, {c.vocab_size, h}});
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    t.push_back({L(i, "input_layernorm.weight"), dt, {h}});
    t.push_back({L(i, "self_attn.q_proj.weight"), dt, {c.q_size(), h}});
    t.push_back({L(i, "self_attn.k_proj.weight"), dt, {c.kv_size(), h}});
    t.push_back({L(i, "self_attn.v_proj.weight"), dt, {c.kv_size(), h}});
    if (c.attention_bias) {
      t.push_back({L(i, "self_attn.q_proj.bias"), dt, {c.q_size()}});
      t.push_back({L(i, "self_attn.k_proj.bias"), dt, {c.kv_size()}});
      t.push_back({L(i, "self_attn.v_proj.bias"), dt, {c.kv_size()}});
    }
    if (c.has_qk_norm()) {
      t.push_back({L(i, "self_attn.q_norm.weight"), dt, {c.head_dim}});
      t.push_back({L(i, "self_attn.k_norm.weight"), dt, {c.head_dim}});
    }
    t.push_back({L(i, "self_attn.o_proj.weight"), dt, {h, c.q_size()}});
    t.push_back({L(i, "post_attention_layernorm.weight"), dt, {h}});
    if (c.is_moe_layer(i)) {
      t.push_back({L(i, "mlp.gate.weight"), dt, {c.num_experts, h}});
      const int64_t im = c.moe_intermediate_size;
      for (int64_t e = 0; e < c.num_experts; ++e) {
        t.push_back({E(i, e, "gate_proj"), dt, {im, h}});
        t.push_back({E(i, e, "up_proj"), dt, {im, h}});
        t.push_back({E(i, e, "down_proj"), dt, {h, im}});
      }
    } else {
      t.push_back({L(i, "mlp.gate_proj.weight"), dt, {c.intermediate_size, h}});
      t.push_back({L(i, "mlp.up_proj.weight"), dt, {c.intermediate_size, h}});
      t.push_back({L(i, "mlp.down_proj.weight"), dt, {h, c.intermediate_size}});
    }
  }
  t.push_back({"model.norm.weight", dt, {h}});
  if (!c.tie_word_embeddings) t.push_back({"lm_head.weight", dt, {c.vocab_size, h}});
  return t;
}

namespace {

// Megatron split dim of a HF tensor: 0 column parallel, 1 row parallel, -1 replicated.
int TpSplitDim(std::string_view name) {
  for (std::string_view s : {"q_proj.weight", "k_proj.weight", "v_proj.weight", "q_proj.bias", "k_proj.bias",
                             "v_proj.bias", "gate_proj.weight", "up_proj.weight", "embed_tokens.weight",
                             "lm_head.weight"}) {
    if (EndsWith(name, s)) return 0;
  }
  if (EndsWith(name, "o_proj.weight") || EndsWith(name, "down_proj.weight")) return 1;
  return -1;
}

}  // namespace

Result<Manifest> MakeTrainerManifest(const ModelConfig& config, const TrainerLayout& layout, std::string version) {
  RC_ASSIGN_OR_RETURN(std::vector<TensorSpec> specs, ListSourceTensors(config));
  Manifest m;
  m.model = config.name;
  m.version = std::move(version);
  m.expected_ranks = layout.ranks;
  m.tables.reserve(specs.size());
  const int64_t n = layout.ranks;
  for (TensorSpec& s : specs) {
    ShardTable t{s.name, s.dtype, s.shape, {}};
    int split = -1;
    if (layout.kind == TrainerLayout::Kind::kFsdp) split = 0;
    if (layout.kind == TrainerLayout::Kind::kTp) split = TpSplitDim(s.name);
    if (split < 0) {
      for (int32_t r = 0; r < n; ++r) t.shards.push_back({r, Shape(s.shape.size(), 0), s.shape, "", 0});
    } else {
      const size_t d = static_cast<size_t>(split);
      const int64_t size = s.shape[d];
      int64_t piece = (size + n - 1) / n;
      if (layout.kind == TrainerLayout::Kind::kTp && size % n != 0) {
        return InvalidArgument(fmt::format("trainer layout {}: tensor {} dim {} of size {} does not split evenly",
                                           layout.ToString(), s.name, d, size));
      }
      for (int32_t r = 0; r < n; ++r) {
        const int64_t start = r * piece;
        if (start >= size) break;
        ShardInfo shard{r, Shape(s.shape.size(), 0), s.shape, "", 0};
        shard.offset[d] = start;
        shard.shape[d] = std::min(piece, size - start);
        t.shards.push_back(std::move(shard));
      }
    }
    m.tables.push_back(std::move(t));
  }
  return m;
}

// ---- Engine parameters and the loader ----------------------------------------------------------

Status CheckEngineLayout(const ModelConfig& c, const EngineLayout& l) {
  RC_RETURN_IF_ERROR(ValidateModelConfig(c));
  const std::string what = fmt::format("model {} at engine layout {}", c.name, l.ToString());
  const int64_t n = l.tp;
  if (l.tp < 1 || l.ep < 1) return InvalidArgument(what + ": sizes must be positive");
  if (l.tp > 1 && l.ep > 1 && l.tp != l.ep) return InvalidArgument(what + ": ep must equal tp");
  if (c.num_attention_heads % n != 0) {
    return InvalidArgument(fmt::format("{}: num_attention_heads {} is not divisible by tp {}", what,
                                       c.num_attention_heads, n));
  }
  const int64_t hkv = c.num_key_value_heads;
  if (hkv % n != 0 && n % hkv != 0) {
    return InvalidArgument(fmt::format("{}: num_key_value_heads {} and tp {}: neither divides the other", what, hkv, n));
  }
  bool any_dense = false;
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) any_dense = any_dense || !c.is_moe_layer(i);
  if (any_dense && c.intermediate_size % n != 0) {
    return InvalidArgument(fmt::format("{}: intermediate_size {} is not divisible by tp {}", what,
                                       c.intermediate_size, n));
  }
  if (l.ep > 1 && !c.is_moe()) return InvalidArgument(what + ": ep given but the model has no experts");
  if (c.is_moe() && c.num_experts % l.ep != 0) {
    return InvalidArgument(fmt::format("{}: num_experts {} is not divisible by ep {}", what, c.num_experts, l.ep));
  }
  return OkStatus();
}

namespace {

struct RankGeometry {
  int64_t n, r;          // tp size and tp rank
  int64_t m, re;         // ep size and ep rank
  int64_t q_heads;       // q heads on this rank
  int64_t kv_heads;      // kv heads on this rank (KvL)
  int64_t kv_first;      // first kv head of this rank
  int64_t inter;         // dense intermediate rows on this rank
  int64_t experts;       // local experts
};

RankGeometry Geometry(const ModelConfig& c, const EngineLayout& l, int32_t rank) {
  RankGeometry g;
  g.n = l.tp;
  g.r = rank % l.tp;
  g.m = l.ep;
  g.re = rank % l.ep;
  g.q_heads = c.num_attention_heads / g.n;
  const int64_t hkv = c.num_key_value_heads;
  if (hkv >= g.n) {
    g.kv_heads = hkv / g.n;
    g.kv_first = g.r * g.kv_heads;
  } else {
    g.kv_heads = 1;
    g.kv_first = g.r / (g.n / hkv);
  }
  g.inter = c.intermediate_size / g.n;
  g.experts = c.is_moe() ? c.num_experts / g.m : 0;
  return g;
}

Status CheckRank(const EngineLayout& l, int32_t rank) {
  if (rank < 0 || rank >= l.world_size()) {
    return InvalidArgument(fmt::format("engine layout {}: rank {} is outside 0..{}", l.ToString(), rank,
                                       l.world_size() - 1));
  }
  return OkStatus();
}

}  // namespace

Result<std::vector<TensorSpec>> ListEngineParams(const ModelConfig& c, const EngineLayout& l, int32_t rank) {
  RC_RETURN_IF_ERROR(CheckEngineLayout(c, l));
  RC_RETURN_IF_ERROR(CheckRank(l, rank));
  const RankGeometry g = Geometry(c, l, rank);
  const DType dt = l.param_dtype;
  const int64_t h = c.hidden_size, d = c.head_dim;
  const int64_t qkv_rows = (g.q_heads + 2 * g.kv_heads) * d;
  std::vector<TensorSpec> p;
  p.push_back({"model.embed_tokens.weight", dt, {c.vocab_size, h}});
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    p.push_back({L(i, "input_layernorm.weight"), dt, {h}});
    p.push_back({L(i, "self_attn.qkv_proj.weight"), dt, {qkv_rows, h}});
    if (c.attention_bias) p.push_back({L(i, "self_attn.qkv_proj.bias"), dt, {qkv_rows}});
    if (c.has_qk_norm()) {
      p.push_back({L(i, "self_attn.q_norm.weight"), dt, {d}});
      p.push_back({L(i, "self_attn.k_norm.weight"), dt, {d}});
    }
    p.push_back({L(i, "self_attn.o_proj.weight"), dt, {h, g.q_heads * d}});
    p.push_back({L(i, "post_attention_layernorm.weight"), dt, {h}});
    if (c.is_moe_layer(i)) {
      const int64_t im = c.moe_intermediate_size;
      p.push_back({L(i, "mlp.gate.weight"), dt, {c.num_experts, h}});
      p.push_back({L(i, "mlp.experts.w13_weight"), dt, {g.experts, 2 * im, h}});
      p.push_back({L(i, "mlp.experts.w2_weight"), dt, {g.experts, h, im}});
    } else {
      p.push_back({L(i, "mlp.gate_up_proj.weight"), dt, {2 * g.inter, h}});
      p.push_back({L(i, "mlp.down_proj.weight"), dt, {h, g.inter}});
    }
  }
  p.push_back({"model.norm.weight", dt, {h}});
  p.push_back({"lm_head.weight", dt, {c.vocab_size, h}});
  return p;
}

Status LoadEngineRank(const ModelConfig& c, const EngineLayout& l, int32_t rank, LoadContext& ctx) {
  RC_RETURN_IF_ERROR(CheckEngineLayout(c, l));
  RC_RETURN_IF_ERROR(CheckRank(l, rank));
  const RankGeometry g = Geometry(c, l, rank);
  const int64_t h = c.hidden_size, d = c.head_dim;
  const int64_t qkv_rows = (g.q_heads + 2 * g.kv_heads) * d;
  constexpr bool kConvert = true;  // the engine computes in its param dtype

  auto whole = [&](const std::string& src, const std::string& param) -> Status {
    RC_ASSIGN_OR_RETURN(SourceView v, ctx.Source(src));
    return ctx.CopyInto(v, DestRegion::Whole(param, v.shape(), kConvert));
  };
  // Rows [first, first + rows) of `src` into rows [at, at + rows) of `param`.
  auto rows = [&](const std::string& src, int64_t first, int64_t count, const std::string& param,
                  const Shape& param_shape, int64_t at) -> Status {
    RC_ASSIGN_OR_RETURN(SourceView v, ctx.Source(src));
    return ctx.CopyInto(v.Narrow(0, first, count), DestRegion::Rows(param, param_shape, at, count, kConvert));
  };
  auto columns = [&](const std::string& src, int64_t first, int64_t count, const std::string& param) -> Status {
    RC_ASSIGN_OR_RETURN(SourceView v, ctx.Source(src));
    const SourceView cols = v.Narrow(1, first, count);
    return ctx.CopyInto(cols, DestRegion::Whole(param, cols.shape(), kConvert));
  };

  RC_RETURN_IF_ERROR(whole("model.embed_tokens.weight", "model.embed_tokens.weight"));
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    RC_RETURN_IF_ERROR(whole(L(i, "input_layernorm.weight"), L(i, "input_layernorm.weight")));
    const int64_t q_first = g.r * g.q_heads * d, q_rows = g.q_heads * d;
    const int64_t kv_first = g.kv_first * d, kv_rows = g.kv_heads * d;
    for (std::string_view kind : {"weight", "bias"}) {
      if (kind == "bias" && !c.attention_bias) continue;
      const std::string param = L(i, fmt::format("self_attn.qkv_proj.{}", kind));
      const Shape shape = kind == "weight" ? Shape{qkv_rows, h} : Shape{qkv_rows};
      RC_RETURN_IF_ERROR(rows(L(i, fmt::format("self_attn.q_proj.{}", kind)), q_first, q_rows, param, shape, 0));
      RC_RETURN_IF_ERROR(
          rows(L(i, fmt::format("self_attn.k_proj.{}", kind)), kv_first, kv_rows, param, shape, q_rows));
      RC_RETURN_IF_ERROR(
          rows(L(i, fmt::format("self_attn.v_proj.{}", kind)), kv_first, kv_rows, param, shape, q_rows + kv_rows));
    }
    if (c.has_qk_norm()) {
      RC_RETURN_IF_ERROR(whole(L(i, "self_attn.q_norm.weight"), L(i, "self_attn.q_norm.weight")));
      RC_RETURN_IF_ERROR(whole(L(i, "self_attn.k_norm.weight"), L(i, "self_attn.k_norm.weight")));
    }
    RC_RETURN_IF_ERROR(columns(L(i, "self_attn.o_proj.weight"), q_first, q_rows, L(i, "self_attn.o_proj.weight")));
    RC_RETURN_IF_ERROR(whole(L(i, "post_attention_layernorm.weight"), L(i, "post_attention_layernorm.weight")));
    if (c.is_moe_layer(i)) {
      RC_RETURN_IF_ERROR(whole(L(i, "mlp.gate.weight"), L(i, "mlp.gate.weight")));
      const int64_t im = c.moe_intermediate_size;
      const std::string w13 = L(i, "mlp.experts.w13_weight");
      const std::string w2 = L(i, "mlp.experts.w2_weight");
      for (int64_t j = 0; j < g.experts; ++j) {
        const int64_t e = g.re * g.experts + j;
        RC_ASSIGN_OR_RETURN(SourceView gate, ctx.Source(E(i, e, "gate_proj")));
        RC_ASSIGN_OR_RETURN(SourceView up, ctx.Source(E(i, e, "up_proj")));
        RC_ASSIGN_OR_RETURN(SourceView down, ctx.Source(E(i, e, "down_proj")));
        RC_RETURN_IF_ERROR(ctx.CopyInto(gate, DestRegion{w13, j * 2 * im * h, {im, h}, {h, 1}, kConvert}));
        RC_RETURN_IF_ERROR(ctx.CopyInto(up, DestRegion{w13, j * 2 * im * h + im * h, {im, h}, {h, 1}, kConvert}));
        RC_RETURN_IF_ERROR(ctx.CopyInto(down, DestRegion{w2, j * h * im, {h, im}, {im, 1}, kConvert}));
      }
    } else {
      const std::string gate_up = L(i, "mlp.gate_up_proj.weight");
      const Shape shape{2 * g.inter, h};
      RC_RETURN_IF_ERROR(rows(L(i, "mlp.gate_proj.weight"), g.r * g.inter, g.inter, gate_up, shape, 0));
      RC_RETURN_IF_ERROR(rows(L(i, "mlp.up_proj.weight"), g.r * g.inter, g.inter, gate_up, shape, g.inter));
      RC_RETURN_IF_ERROR(columns(L(i, "mlp.down_proj.weight"), g.r * g.inter, g.inter, L(i, "mlp.down_proj.weight")));
    }
  }
  RC_RETURN_IF_ERROR(whole("model.norm.weight", "model.norm.weight"));
  RC_RETURN_IF_ERROR(whole(c.tie_word_embeddings ? "model.embed_tokens.weight" : "lm_head.weight", "lm_head.weight"));
  return OkStatus();
}

Result<Capture> CaptureEngineRank(const ModelConfig& config, const EngineLayout& layout, int32_t rank) {
  RC_ASSIGN_OR_RETURN(std::vector<TensorSpec> sources, ListSourceTensors(config));
  RC_ASSIGN_OR_RETURN(std::vector<TensorSpec> params, ListEngineParams(config, layout, rank));
  CaptureContext ctx(std::move(sources), std::move(params));
  RC_RETURN_IF_ERROR(LoadEngineRank(config, layout, rank, ctx));
  return ctx.Take();
}

}  // namespace rc::refit
