#include "engine/fp8_weights.h"

#include <bit>
#include <cstring>

#include <fmt/format.h>

#include "rolloutcore/refit/digest.h"

namespace rc::engine {

Result<std::unique_ptr<Fp8Weights>> Fp8Weights::Create(const ModelSpec& spec, const std::vector<RankLayout>& layouts,
                                                       formats::Fp8Scheme scheme) {
  std::unique_ptr<Fp8Weights> w(new Fp8Weights());
  w->scheme_ = scheme;
  const int64_t H = spec.hidden_size, D = spec.head_dim, I = spec.intermediate_size;
  const int64_t Q = spec.num_heads * D, V = spec.num_kv_heads * D;  // q rows, and k (or v) rows
  const size_t tp = layouts.size();
  for (int64_t li = 0; li < spec.num_layers; ++li) {
    const std::string prefix = "model.layers." + std::to_string(li) + ".";
    for (const char* proj : kFp8Projections) {
      Param p;
      p.name = prefix + proj;
      const std::string_view what(proj);
      const bool qkv = what.starts_with("self_attn.qkv"), o = what.starts_with("self_attn.o_");
      const bool gate_up = what.starts_with("mlp.gate_up"), down = what.starts_with("mlp.down");
      const int64_t rows = qkv ? Q + 2 * V : o || down ? H : 2 * I;
      const int64_t cols = qkv || gate_up ? H : o ? Q : I;
      p.layout = formats::Fp8Layout{scheme, rows, cols};
      RC_RETURN_IF_ERROR(p.layout.Validate());
      p.pieces.resize(tp);
      p.buffers.resize(tp);
      for (size_t r = 0; r < tp; ++r) {
        const RankLayout& l = layouts[r];
        std::vector<Piece>& pc = p.pieces[r];
        int64_t local_rows = 0, local_cols = 0;
        if (qkv) {
          const int64_t hq = l.q_heads * D, hk = l.kv_heads * D;
          // The first rank holding a kv head owns its rows (kv heads are replicated when tp > kv heads).
          bool kv_owner = true;
          for (size_t s = 0; s < r; ++s) kv_owner = kv_owner && layouts[s].first_kv_head != l.first_kv_head;
          pc.push_back({0, {static_cast<int64_t>(r) * hq, 0, hq, H}, true});
          pc.push_back({hq, {Q + l.first_kv_head * D, 0, hk, H}, kv_owner});
          pc.push_back({hq + hk, {Q + V + l.first_kv_head * D, 0, hk, H}, kv_owner});
          local_rows = hq + 2 * hk;
          local_cols = H;
        } else if (gate_up) {
          const int64_t il = l.intermediate;
          pc.push_back({0, {static_cast<int64_t>(r) * il, 0, il, H}, true});
          pc.push_back({il, {I + static_cast<int64_t>(r) * il, 0, il, H}, true});
          local_rows = 2 * il;
          local_cols = H;
        } else {
          const int64_t lc = o ? l.q_heads * D : l.intermediate;
          pc.push_back({0, {0, static_cast<int64_t>(r) * lc, H, lc}, true});
          local_rows = H;
          local_cols = lc;
        }
        Buffer& b = p.buffers[r];
        b.rows = local_rows;
        b.cols = local_cols;
        if (scheme == formats::Fp8Scheme::kBlock) {
          b.scale_block_cols = p.layout.block_cols;
          b.scale_cols = (local_cols + b.scale_block_cols - 1) / b.scale_block_cols;
          for (const Piece& piece : pc) {
            if (piece.box.col0 % p.layout.block_cols != 0) {
              return InvalidArgument(fmt::format(
                  "fp8_per_block with tensor-parallel-size {}: rank {}'s columns of {} start at column {}, not on a "
                  "{}-column block (each rank's slice must be whole blocks)",
                  tp, r, p.name, piece.box.col0, p.layout.block_cols));
            }
          }
        } else {
          b.scale_cols = 1;
          b.scale_block_cols = std::max<int64_t>(local_cols, 1);
        }
        b.q.assign(static_cast<size_t>(local_rows * local_cols), 0);
        b.row_scales.assign(static_cast<size_t>(local_rows * b.scale_cols), 0.f);
      }
      w->index_[p.name] = w->params_.size();
      w->params_.push_back(std::move(p));
    }
  }
  return w;
}

Result<const uint16_t*> Fp8Weights::Bf16Of(const ParameterStore& ps, const Param& p, int rank) {
  const Buffer& b = p.buffers[static_cast<size_t>(rank)];
  RC_ASSIGN_OR_RETURN(const Parameter* param, ps.Get(p.name, {b.rows, b.cols}));
  if (param->bf16() == nullptr) {
    return InvalidArgument(fmt::format("{} is {}: FP8 serving quantizes bf16 weights", p.name, DTypeName(param->dtype)));
  }
  return param->bf16();
}

Status Fp8Weights::Quantize(const std::vector<const ParameterStore*>& params, int threads) {
  for (Param& p : params_) {
    if (params.size() != p.pieces.size()) return Internal("fp8 quantize: one parameter store per rank expected");
    // Every rank's amax per scale group, merged (vLLM all-reduces it over the TP group).
    std::vector<uint16_t> amax(static_cast<size_t>(p.layout.NumScales()), 0);
    std::vector<const uint16_t*> src(params.size());
    for (size_t r = 0; r < params.size(); ++r) {
      RC_ASSIGN_OR_RETURN(src[r], Bf16Of(*params[r], p, static_cast<int>(r)));
      const Buffer& b = p.buffers[r];
      for (const Piece& piece : p.pieces[r]) {
        std::span<const uint16_t> rows(src[r] + piece.local_row0 * b.cols, static_cast<size_t>(piece.box.rows * b.cols));
        RC_RETURN_IF_ERROR(formats::Fp8BoxAmax(rows, p.layout, piece.box, amax, p.name, threads));
      }
    }
    std::vector<float> scales(amax.size());
    formats::Fp8ScalesFromAmax(p.layout, amax, scales);
    for (size_t r = 0; r < params.size(); ++r) {
      Buffer& b = p.buffers[r];
      for (const Piece& piece : p.pieces[r]) {
        const size_t at = static_cast<size_t>(piece.local_row0 * b.cols), n = static_cast<size_t>(piece.box.rows * b.cols);
        RC_RETURN_IF_ERROR(formats::QuantizeBf16BoxToFp8(std::span<const uint16_t>(src[r] + at, n), p.layout, piece.box,
                                                         scales, std::span<uint8_t>(b.q.data() + at, n), p.name,
                                                         threads));
        for (int64_t lr = 0; lr < piece.box.rows; ++lr) {
          float* rs = &b.row_scales[static_cast<size_t>((piece.local_row0 + lr) * b.scale_cols)];
          for (int64_t gc = 0; gc < b.scale_cols; ++gc) {
            rs[gc] = scales[static_cast<size_t>(
                p.layout.GroupOf(piece.box.row0 + lr, piece.box.col0 + gc * b.scale_block_cols))];
          }
        }
      }
    }
  }
  return OkStatus();
}

const Fp8Weights::Buffer* Fp8Weights::Find(int rank, const std::string& name) const {
  auto it = index_.find(name);
  if (it == index_.end() || rank < 0 || static_cast<size_t>(rank) >= params_[it->second].buffers.size()) return nullptr;
  return &params_[it->second].buffers[static_cast<size_t>(rank)];
}

Fp8Weights::Buffer* Fp8Weights::MutableForTesting(int rank, const std::string& name) {
  return const_cast<Buffer*>(Find(rank, name));
}

std::vector<Fp8Weights::Buffer*> Fp8Weights::BuffersForTesting() {
  std::vector<Buffer*> out;
  for (Param& p : params_)
    for (Buffer& b : p.buffers) out.push_back(&b);
  return out;
}

int64_t Fp8Weights::Bytes() const {
  int64_t n = 0;
  for (const Param& p : params_)
    for (const Buffer& b : p.buffers) n += static_cast<int64_t>(b.q.size() + b.row_scales.size() * sizeof(float));
  return n;
}

Result<Fp8Weights::Digests> Fp8Weights::Live() const {
  Digests out;
  for (const Param& p : params_) {
    const refit::Shape shape{p.layout.rows, p.layout.cols};
    const auto g = p.layout.ScaleGrid();
    const refit::Shape grid{g[0], g[1]};
    refit::Fp8ImageDigest d;
    // Bytes: the owners' pieces are digested; every other copy must equal its owner's.
    for (size_t r = 0; r < p.pieces.size(); ++r) {
      const Buffer& b = p.buffers[r];
      for (const Piece& piece : p.pieces[r]) {
        const uint8_t* q = b.q.data() + piece.local_row0 * b.cols;
        const size_t n = static_cast<size_t>(piece.box.rows * piece.box.cols);
        if (piece.owner) {
          d += refit::Fp8ImagePart(shape, refit::Box{{piece.box.row0, piece.box.col0}, {piece.box.rows, piece.box.cols}},
                                   q, grid, refit::Box{{0, 0}, {0, 0}}, nullptr);
          continue;
        }
        for (size_t s = 0; s < r; ++s) {
          for (const Piece& other : p.pieces[s]) {
            if (!other.owner || other.box.row0 != piece.box.row0 || other.box.col0 != piece.box.col0) continue;
            const uint8_t* oq = p.buffers[s].q.data() + other.local_row0 * p.buffers[s].cols;
            if (std::memcmp(q, oq, n) != 0) {
              return DataLoss(fmt::format("fp8 image of {}: rank {}'s copy of rows [{}, {}) differs from rank {}'s",
                                          p.name, r, piece.box.row0, piece.box.row0 + piece.box.rows, s));
            }
          }
        }
      }
    }
    // Scales: the first copy of each group's scale is digested; every other copy must be bitwise equal.
    std::vector<float> canonical(static_cast<size_t>(p.layout.NumScales()), 0.f);
    std::vector<uint8_t> seen(canonical.size(), 0);
    for (size_t r = 0; r < p.pieces.size(); ++r) {
      const Buffer& b = p.buffers[r];
      for (const Piece& piece : p.pieces[r]) {
        for (int64_t lr = 0; lr < piece.box.rows; ++lr) {
          const float* rs = &b.row_scales[static_cast<size_t>((piece.local_row0 + lr) * b.scale_cols)];
          for (int64_t gc = 0; gc < b.scale_cols; ++gc) {
            const int64_t row = piece.box.row0 + lr, col = piece.box.col0 + gc * b.scale_block_cols;
            const auto grp = static_cast<size_t>(p.layout.GroupOf(row, col));
            if (!seen[grp]) {
              seen[grp] = 1;
              canonical[grp] = rs[gc];
            } else if (std::bit_cast<uint32_t>(canonical[grp]) != std::bit_cast<uint32_t>(rs[gc])) {
              return DataLoss(fmt::format(
                  "fp8 image of {}: rank {} row {} holds scale {} for the group of column {}, another row of that group "
                  "holds {} (copies of one scale must agree)",
                  p.name, r, row, rs[gc], col, canonical[grp]));
            }
          }
        }
      }
    }
    for (size_t i = 0; i < seen.size(); ++i) {
      if (!seen[i]) return Internal(fmt::format("fp8 image of {}: no rank holds scale group {}", p.name, i));
    }
    d += refit::Fp8ImagePart(shape, refit::Box{{0, 0}, {0, 0}}, nullptr, grid, refit::FullBox(grid), canonical.data());
    out[p.name] = d;
  }
  return out;
}

Result<Fp8Weights::Digests> Fp8Weights::Expected(const std::vector<const ParameterStore*>& params, int threads) const {
  Digests out;
  for (const Param& p : params_) {
    if (params.size() != p.pieces.size()) return Internal("fp8 expected digest: one parameter store per rank expected");
    // The whole bf16 parameter, gathered from the owners' pieces.
    std::vector<uint16_t> whole(static_cast<size_t>(p.layout.NumElements()));
    for (size_t r = 0; r < params.size(); ++r) {
      RC_ASSIGN_OR_RETURN(const uint16_t* src, Bf16Of(*params[r], p, static_cast<int>(r)));
      const int64_t lc = p.buffers[r].cols;
      for (const Piece& piece : p.pieces[r]) {
        if (!piece.owner) continue;
        for (int64_t lr = 0; lr < piece.box.rows; ++lr) {
          std::memcpy(&whole[static_cast<size_t>((piece.box.row0 + lr) * p.layout.cols + piece.box.col0)],
                      src + (piece.local_row0 + lr) * lc, static_cast<size_t>(piece.box.cols) * sizeof(uint16_t));
        }
      }
    }
    std::vector<uint8_t> q(whole.size());
    std::vector<float> s(static_cast<size_t>(p.layout.NumScales()));
    RC_RETURN_IF_ERROR(formats::QuantizeBf16ToFp8(whole, p.layout, q, s, p.name, threads));
    const refit::Shape shape{p.layout.rows, p.layout.cols};
    const auto g = p.layout.ScaleGrid();
    const refit::Shape grid{g[0], g[1]};
    out[p.name] = refit::Fp8ImagePart(shape, refit::FullBox(shape), q.data(), grid, refit::FullBox(grid), s.data());
  }
  return out;
}

}  // namespace rc::engine
