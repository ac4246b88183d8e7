#include "engine/model.h"

#include <cmath>
#include <cstring>
#include <functional>

#include "engine/kernels.h"

namespace rc::engine {

std::vector<ParameterDecl> EngineParameterDecls(const ModelSpec& spec, const RankLayout& l) {
  const int64_t h = spec.hidden_size, d = spec.head_dim, v = spec.vocab_size;
  std::vector<ParameterDecl> out;
  out.push_back({"model.embed_tokens.weight", {v, h}, ""});
  for (int64_t i = 0; i < spec.num_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    out.push_back({p + "input_layernorm.weight", {h}, ""});
    out.push_back({p + "post_attention_layernorm.weight", {h}, ""});
    out.push_back({p + "self_attn.qkv_proj.weight", {(l.q_heads + 2 * l.kv_heads) * d, h}, ""});
    if (spec.qkv_bias) out.push_back({p + "self_attn.qkv_proj.bias", {(l.q_heads + 2 * l.kv_heads) * d}, ""});
    if (spec.qk_norm) {
      out.push_back({p + "self_attn.q_norm.weight", {d}, ""});
      out.push_back({p + "self_attn.k_norm.weight", {d}, ""});
    }
    out.push_back({p + "self_attn.o_proj.weight", {h, l.q_heads * d}, ""});
    out.push_back({p + "mlp.gate_up_proj.weight", {2 * l.intermediate, h}, ""});
    out.push_back({p + "mlp.down_proj.weight", {h, l.intermediate}, ""});
  }
  out.push_back({"model.norm.weight", {h}, ""});
  out.push_back({"lm_head.weight", {v, h}, spec.tie_word_embeddings ? "model.embed_tokens.weight" : ""});
  return out;
}

namespace {

Result<WeightRef> Ref(const ParameterStore& ps, std::string_view name, const std::vector<int64_t>& shape) {
  RC_ASSIGN_OR_RETURN(const Parameter* p, ps.Get(name, shape));
  if (p->dtype == DType::kBF16) return WeightRef(static_cast<const uint16_t*>(p->bf16()));
  return WeightRef(static_cast<const float*>(p->f32()));
}

// Forward's first step: checks every sequence of the batch (its KV blocks, its token ids, the
// logits rows it asks for) and flattens the batch into the kept scratch vectors (cleared first; no
// allocation beyond their growth): token t is tok_id[t] of seq tok_seq[t] at position tok_pos[t];
// logit_rows are the tokens whose logits the caller gets, in order.
Status FlattenBatch(const std::vector<ForwardSeq>& seqs, int64_t block_size, int64_t num_blocks, int64_t vocab,
                    std::vector<int32_t>* tok_id, std::vector<int64_t>* tok_seq, std::vector<int64_t>* tok_pos,
                    std::vector<int64_t>* logit_rows) {
  tok_id->clear();
  tok_seq->clear();
  tok_pos->clear();
  logit_rows->clear();
  for (size_t s = 0; s < seqs.size(); ++s) {
    const ForwardSeq& fs = seqs[s];
    const int64_t need_blocks = (fs.start_pos + fs.num_tokens + block_size - 1) / block_size;
    if (fs.block_table == nullptr || static_cast<int64_t>(fs.block_table->size()) < need_blocks) {
      return Internal("forward: sequence " + std::to_string(s) + " has too few KV blocks");
    }
    for (int32_t b : *fs.block_table) {
      if (b < 0 || b >= num_blocks) return Internal("forward: KV block id out of range");
    }
    for (int64_t i = 0; i < fs.num_tokens; ++i) {
      if (fs.tokens[i] < 0 || fs.tokens[i] >= vocab) {
        return InvalidArgument("token id " + std::to_string(fs.tokens[i]) + " is outside the vocabulary of " +
                               std::to_string(vocab));
      }
      tok_id->push_back(fs.tokens[i]);
      tok_seq->push_back(static_cast<int64_t>(s));
      tok_pos->push_back(fs.start_pos + i);
    }
    if (fs.want_logits && fs.num_tokens > 0) {
      if (fs.logit_tokens < 1 || fs.logit_tokens > fs.num_tokens) {
        return Internal("forward: sequence " + std::to_string(s) + " asks for " + std::to_string(fs.logit_tokens) +
                        " logits rows of " + std::to_string(fs.num_tokens) + " new tokens");
      }
      const auto last = static_cast<int64_t>(tok_id->size());
      for (int64_t k = fs.logit_tokens; k >= 1; --k) logit_rows->push_back(last - k);
    }
  }
  return OkStatus();
}

}  // namespace

Result<std::unique_ptr<Model>> Model::Create(const ModelSpec& spec, int tp, int64_t num_blocks,
                                             int64_t block_size, ThreadPool* pool, DType weight_dtype,
                                             std::optional<formats::Fp8Scheme> fp8) {
  RC_RETURN_IF_ERROR(spec.Validate());
  if (!IsParameterDType(weight_dtype)) {
    return InvalidArgument("weight dtype " + std::string(DTypeName(weight_dtype)) + ": expected F32 or BF16");
  }
  if (fp8 && weight_dtype != DType::kBF16) {
    return InvalidArgument("quantization " + std::string(formats::Fp8VllmQuantization(*fp8)) + " quantizes BF16 weights; " +
                           "these weights are kept in " + std::string(DTypeName(weight_dtype)) +
                           " (an F32 or F16 checkpoint): convert it to bf16 first");
  }
  if (num_blocks <= 0 || block_size <= 0) {
    return InvalidArgument("num-kv-blocks and block-size must be positive");
  }
  std::unique_ptr<Model> m(new Model(spec, num_blocks, block_size, pool));
  m->weight_dtype_ = weight_dtype;
  for (int r = 0; r < tp; ++r) {
    auto rank = std::make_unique<Rank>();
    RC_ASSIGN_OR_RETURN(rank->layout, MakeRankLayout(spec, tp, r));
    for (const auto& decl : EngineParameterDecls(spec, rank->layout)) {
      if (decl.alias_of.empty()) {
        RC_RETURN_IF_ERROR(rank->params.Add(decl.name, decl.shape, weight_dtype));
      } else {
        RC_RETURN_IF_ERROR(rank->params.Alias(decl.name, decl.alias_of));
      }
    }
    const size_t kv = static_cast<size_t>(num_blocks * block_size * rank->layout.kv_heads * spec.head_dim);
    rank->k_cache.assign(static_cast<size_t>(spec.num_layers), std::vector<float>(kv, 0.f));
    rank->v_cache.assign(static_cast<size_t>(spec.num_layers), std::vector<float>(kv, 0.f));
    m->ranks_.push_back(std::move(rank));
  }
  m->inv_freq_ = RopeInvFreq(spec);
  if (fp8) {
    std::vector<RankLayout> layouts;
    for (const auto& r : m->ranks_) layouts.push_back(r->layout);
    RC_ASSIGN_OR_RETURN(m->fp8_, Fp8Weights::Create(spec, layouts, *fp8));
    RC_RETURN_IF_ERROR(m->Quantize());
  }
  RC_RETURN_IF_ERROR(m->Bind());
  return m;
}

int64_t Model::KvBytes() const {
  int64_t n = 0;
  for (const auto& r : ranks_)
    for (size_t i = 0; i < r->k_cache.size(); ++i)
      n += static_cast<int64_t>((r->k_cache[i].size() + r->v_cache[i].size()) * sizeof(float));
  return n;
}

int64_t Model::WeightBytes() const {
  int64_t n = 0;
  for (const auto& r : ranks_) n += r->params.TotalBytes();
  if (fp8_) n += fp8_->Bytes();
  return n;
}

std::vector<const ParameterStore*> Model::AllParams() const {
  std::vector<const ParameterStore*> out;
  for (const auto& r : ranks_) out.push_back(&r->params);
  return out;
}

Status Model::Quantize() {
  if (!fp8_) return OkStatus();
  RC_RETURN_IF_ERROR(fp8_->Quantize(AllParams(), pool_ != nullptr ? pool_->num_threads() : 1));
  return Bind();
}

Result<WeightBinding> Model::BindWith(const RefLookup& get) const {
  const int64_t h = spec_.hidden_size, d = spec_.head_dim, v = spec_.vocab_size;
  WeightBinding w;
  w.layers.resize(ranks_.size());
  for (size_t r = 0; r < ranks_.size(); ++r) {
    const RankLayout& l = ranks_[r]->layout;
    w.layers[r].assign(static_cast<size_t>(spec_.num_layers), WeightBinding::Layer{});
    for (int64_t i = 0; i < spec_.num_layers; ++i) {
      const std::string p = "model.layers." + std::to_string(i) + ".";
      WeightBinding::Layer& L = w.layers[r][static_cast<size_t>(i)];
      const int64_t qkv_rows = (l.q_heads + 2 * l.kv_heads) * d;
      RC_ASSIGN_OR_RETURN(L.in_norm, get(r, p + "input_layernorm.weight", {h}));
      RC_ASSIGN_OR_RETURN(L.post_norm, get(r, p + "post_attention_layernorm.weight", {h}));
      RC_ASSIGN_OR_RETURN(L.qkv, get(r, p + "self_attn.qkv_proj.weight", {qkv_rows, h}));
      if (spec_.qkv_bias) {
        RC_ASSIGN_OR_RETURN(L.qkv_bias, get(r, p + "self_attn.qkv_proj.bias", {qkv_rows}));
      }
      if (spec_.qk_norm) {
        RC_ASSIGN_OR_RETURN(L.q_norm, get(r, p + "self_attn.q_norm.weight", {d}));
        RC_ASSIGN_OR_RETURN(L.k_norm, get(r, p + "self_attn.k_norm.weight", {d}));
      }
      RC_ASSIGN_OR_RETURN(L.o, get(r, p + "self_attn.o_proj.weight", {h, l.q_heads * d}));
      RC_ASSIGN_OR_RETURN(L.gate_up, get(r, p + "mlp.gate_up_proj.weight", {2 * l.intermediate, h}));
      RC_ASSIGN_OR_RETURN(L.down, get(r, p + "mlp.down_proj.weight", {h, l.intermediate}));
    }
  }
  RC_ASSIGN_OR_RETURN(w.embed, get(0, "model.embed_tokens.weight", {v, h}));
  RC_ASSIGN_OR_RETURN(w.final_norm, get(0, "model.norm.weight", {h}));
  RC_ASSIGN_OR_RETURN(w.lm_head, get(0, "lm_head.weight", {v, h}));
  return w;
}

Status Model::Bind() {
  RC_ASSIGN_OR_RETURN(live_, BindWith([this](size_t r, const std::string& name, const std::vector<int64_t>& shape) {
                        return Ref(ranks_[r]->params, name, shape);
                      }));
  if (fp8_) {
    for (size_t r = 0; r < ranks_.size(); ++r) {
      for (int64_t i = 0; i < spec_.num_layers; ++i) {
        const std::string p = "model.layers." + std::to_string(i) + ".";
        WeightBinding::Layer& L = live_.layers[r][static_cast<size_t>(i)];
        for (auto [ref, name] : {std::pair{&L.qkv, "self_attn.qkv_proj.weight"}, {&L.o, "self_attn.o_proj.weight"},
                                 {&L.gate_up, "mlp.gate_up_proj.weight"}, {&L.down, "mlp.down_proj.weight"}}) {
          const Fp8Weights::Buffer* b = fp8_->Find(static_cast<int>(r), p + name);
          if (b == nullptr) return Internal("fp8 serving: no FP8 image of rank " + std::to_string(r) + "'s " + p + name);
          *ref = b->Ref();
        }
      }
    }
  }
  return OkStatus();
}

bool Model::IsLive(const WeightBinding& w) const {
  auto same = [](const WeightRef& a, const WeightRef& b) {
    return a.data == b.data && a.type == b.type && a.scales == b.scales && a.scale_cols == b.scale_cols &&
           a.scale_block_cols == b.scale_block_cols;
  };
  if (w.layers.size() != live_.layers.size()) return false;
  for (size_t r = 0; r < w.layers.size(); ++r) {
    if (w.layers[r].size() != live_.layers[r].size()) return false;
    for (size_t i = 0; i < w.layers[r].size(); ++i) {
      const WeightBinding::Layer& a = w.layers[r][i];
      const WeightBinding::Layer& b = live_.layers[r][i];
      if (!same(a.in_norm, b.in_norm) || !same(a.post_norm, b.post_norm) || !same(a.qkv, b.qkv) ||
          !same(a.qkv_bias, b.qkv_bias) || !same(a.q_norm, b.q_norm) || !same(a.k_norm, b.k_norm) ||
          !same(a.o, b.o) || !same(a.gate_up, b.gate_up) || !same(a.down, b.down)) {
        return false;
      }
    }
  }
  return same(w.embed, live_.embed) && same(w.final_norm, live_.final_norm) && same(w.lm_head, live_.lm_head);
}

Result<WeightBinding> Model::BindImage(const WeightImage& image) const {
  if (fp8_) {
    return FailedPrecondition("the engine serves FP8 (" + std::string(formats::Fp8VllmQuantization(fp8_->scheme())) +
                              "): a staged bf16 image is not what it computes with");
  }
  if (image.size() != ranks_.size()) {
    return InvalidArgument("weight image has " + std::to_string(image.size()) + " ranks; the model has " +
                           std::to_string(ranks_.size()));
  }
  return BindWith([this, &image](size_t r, const std::string& name,
                                 const std::vector<int64_t>& shape) -> Result<WeightRef> {
    // An alias (tied lm_head) follows its target, as in the live store: whatever the image holds
    // under the alias's own name (a staging buffer the capture filled) is not what the live
    // weights read, so it is never read here either.
    const Parameter* live = ranks_[r]->params.Find(name);
    const std::string& key = live != nullptr && !live->alias_of.empty() ? live->alias_of : name;
    auto it = image[r].find(key);
    if (it == image[r].end()) {
      return InvalidArgument("weight image of rank " + std::to_string(r) + " has no parameter " + name);
    }
    int64_t numel = 1;
    for (int64_t e : shape) numel *= e;
    const size_t want = static_cast<size_t>(numel) * DTypeSize(weight_dtype_);
    if (it->second.size() != want) {
      return InvalidArgument("weight image of rank " + std::to_string(r) + ": parameter " + name + " has " +
                             std::to_string(it->second.size()) + " bytes, the engine layout needs " +
                             std::to_string(want));
    }
    if (weight_dtype_ == DType::kBF16) return WeightRef(reinterpret_cast<const uint16_t*>(it->second.data()));
    return WeightRef(reinterpret_cast<const float*>(it->second.data()));
  });
}

size_t Model::Scratch::Bytes() const {
  size_t b = (tok_id.capacity()) * sizeof(int32_t) +
             (tok_seq.capacity() + tok_pos.capacity() + logit_rows.capacity()) * sizeof(int64_t);
  for (const auto* v : {&x, &hbuf, &qkv, &attn, &gu, &act, &normed, &pack}) b += v->capacity() * sizeof(float);
  for (const auto& v : partials) b += v.capacity() * sizeof(float);
  return b;
}

Status Model::Forward(const WeightBinding& w, const std::vector<ForwardSeq>& seqs, std::vector<float>* logits) {
  if (w.layers.size() != ranks_.size()) return Internal("forward: the weight binding does not match the model's ranks");
  const int64_t H = spec_.hidden_size, D = spec_.head_dim, V = spec_.vocab_size;
  // The scratch of the last forward, kept (class comment); freed again when this one grew it
  // past kKeepScratchBytes.
  Scratch& sc = scratch_;
  struct TrimScratch {
    Scratch* sc;
    ~TrimScratch() {
      if (sc->Bytes() > kKeepScratchBytes) *sc = Scratch{};
    }
  } trim{&sc};
  // Flatten the batch: token t belongs to seq tok_seq[t] at position tok_pos[t].
  std::vector<int32_t>& tok_id = sc.tok_id;
  std::vector<int64_t>& tok_seq = sc.tok_seq;
  std::vector<int64_t>& tok_pos = sc.tok_pos;
  std::vector<int64_t>& logit_rows = sc.logit_rows;
  RC_RETURN_IF_ERROR(FlattenBatch(seqs, block_size_, num_blocks_, V, &tok_id, &tok_seq, &tok_pos, &logit_rows));
  const int64_t T = static_cast<int64_t>(tok_id.size());
  if (T == 0) return OkStatus();
  auto slot_of = [&](int64_t t_seq, int64_t pos) {
    const auto& bt = *seqs[static_cast<size_t>(t_seq)].block_table;
    return static_cast<int64_t>(bt[static_cast<size_t>(pos / block_size_)]) * block_size_ + pos % block_size_;
  };

  // Every element of x, hbuf, qkv, gu, act, the partials and normed is written before it is read
  // (the embedding rows, RmsNorm, the matmuls, the SiLU loop); attn accumulates and is zeroed.
  std::vector<float>& x = sc.x;
  x.resize(static_cast<size_t>(T * H));
  for (int64_t t = 0; t < T; ++t) {
    WidenRow(w.embed.Row(tok_id[t], H), H, &x[t * H]);
  }
  std::vector<float>& hbuf = sc.hbuf;
  hbuf.resize(static_cast<size_t>(T * H));
  std::vector<float>& qkv = sc.qkv;
  std::vector<float>& attn = sc.attn;
  std::vector<float>& gu = sc.gu;
  std::vector<float>& act = sc.act;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const float eps = static_cast<float>(spec_.rms_norm_eps);

  // Adds the row-parallel partials of all ranks (in rank order) to the residual stream.
  auto all_reduce_into_x = [&](const std::vector<std::vector<float>>& parts) {
    for (int64_t i = 0; i < T * H; ++i) {
      float s = parts[0][i];
      for (size_t r = 1; r < parts.size(); ++r) s += parts[r][i];
      x[i] += s;
    }
  };
  std::vector<std::vector<float>>& partials = sc.partials;
  partials.resize(ranks_.size());
  for (std::vector<float>& p : partials) p.resize(static_cast<size_t>(T * H));

  for (int64_t li = 0; li < spec_.num_layers; ++li) {
    for (int64_t t = 0; t < T; ++t) RmsNorm(&x[t * H], w.layers[0][static_cast<size_t>(li)].in_norm, H, eps, &hbuf[t * H]);
    for (size_t r = 0; r < ranks_.size(); ++r) {
      Rank& rank = *ranks_[r];
      const WeightBinding::Layer& L = w.layers[r][static_cast<size_t>(li)];
      const int64_t hq = rank.layout.q_heads, hk = rank.layout.kv_heads;
      const int64_t W = (hq + 2 * hk) * D;
      qkv.resize(static_cast<size_t>(T * W));
      MatMulNT(pool_, hbuf.data(), T, H, L.qkv, W, qkv.data(), &sc.pack);
      float* kc = rank.k_cache[static_cast<size_t>(li)].data();
      float* vc = rank.v_cache[static_cast<size_t>(li)].data();
      for (int64_t t = 0; t < T; ++t) {
        float* row = &qkv[t * W];
        if (L.qkv_bias) AddRow(L.qkv_bias, W, row);
        if (L.q_norm) {
          for (int64_t hh = 0; hh < hq; ++hh) RmsNorm(row + hh * D, L.q_norm, D, eps, row + hh * D);
          for (int64_t hh = 0; hh < hk; ++hh) RmsNorm(row + (hq + hh) * D, L.k_norm, D, eps, row + (hq + hh) * D);
        }
        ApplyRope(row, hq + hk, D, tok_pos[t], inv_freq_.data());
        const int64_t slot = slot_of(tok_seq[t], tok_pos[t]);
        std::memcpy(kc + slot * hk * D, row + hq * D, hk * D * sizeof(float));
        std::memcpy(vc + slot * hk * D, row + (hq + hk) * D, hk * D * sizeof(float));
      }
      attn.assign(static_cast<size_t>(T * hq * D), 0.f);
      const int64_t group = hq / hk;
      auto attend = [&](int64_t task) {
        const int64_t t = task / hq, hh = task % hq, kvh = hh / group;
        const float* q = &qkv[t * W + hh * D];
        const int64_t ctx = tok_pos[t] + 1;
        thread_local std::vector<float> scores;
        scores.resize(static_cast<size_t>(ctx));
        float mx = -INFINITY;
        for (int64_t j = 0; j < ctx; ++j) {
          const int64_t slot = slot_of(tok_seq[t], j);
          scores[j] = Dot(q, kc + (slot * hk + kvh) * D, D) * scale;
          mx = std::max(mx, scores[j]);
        }
        float sum = 0.f;
        for (int64_t j = 0; j < ctx; ++j) {
          scores[j] = std::exp(scores[j] - mx);
          sum += scores[j];
        }
        float* out = &attn[(t * hq + hh) * D];
        for (int64_t j = 0; j < ctx; ++j) {
          const float p = scores[j];
          const float* vv = vc + (slot_of(tok_seq[t], j) * hk + kvh) * D;
          for (int64_t dd = 0; dd < D; ++dd) out[dd] += p * vv[dd];
        }
        const float inv = 1.0f / sum;
        for (int64_t dd = 0; dd < D; ++dd) out[dd] *= inv;
      };
      pool_->ParallelFor(T * hq, std::ref(attend));
      MatMulNT(pool_, attn.data(), T, hq * D, L.o, H, partials[r].data(), &sc.pack);
    }
    all_reduce_into_x(partials);

    for (int64_t t = 0; t < T; ++t) RmsNorm(&x[t * H], w.layers[0][static_cast<size_t>(li)].post_norm, H, eps, &hbuf[t * H]);
    for (size_t r = 0; r < ranks_.size(); ++r) {
      Rank& rank = *ranks_[r];
      const WeightBinding::Layer& L = w.layers[r][static_cast<size_t>(li)];
      const int64_t I = rank.layout.intermediate;
      gu.resize(static_cast<size_t>(T * 2 * I));
      act.resize(static_cast<size_t>(T * I));
      MatMulNT(pool_, hbuf.data(), T, H, L.gate_up, 2 * I, gu.data(), &sc.pack);
      for (int64_t t = 0; t < T; ++t) {
        const float* g = &gu[t * 2 * I];
        const float* u = g + I;
        float* a = &act[t * I];
        for (int64_t j = 0; j < I; ++j) a[j] = g[j] / (1.0f + std::exp(-g[j])) * u[j];
      }
      MatMulNT(pool_, act.data(), T, I, L.down, H, partials[r].data(), &sc.pack);
    }
    all_reduce_into_x(partials);
  }

  const int64_t S = static_cast<int64_t>(logit_rows.size());
  if (S == 0) return OkStatus();
  std::vector<float>& normed = sc.normed;
  normed.resize(static_cast<size_t>(S * H));
  for (int64_t s = 0; s < S; ++s) RmsNorm(&x[logit_rows[s] * H], w.final_norm, H, eps, &normed[s * H]);
  const size_t base = logits->size();
  logits->resize(base + static_cast<size_t>(S * V));
  MatMulNT(pool_, normed.data(), S, H, w.lm_head, V, logits->data() + base, &sc.pack);
  return OkStatus();
}

}  // namespace rc::engine
