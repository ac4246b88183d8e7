#include "refit/test_util.h"

#include <cstring>

#include "refit/geometry.h"
#include "rolloutcore/refit/digest.h"
#include "rolloutcore/transport/local.h"

namespace rc::refit::testing {

std::vector<ShardInfo> SplitShards(const Shape& shape, size_t dim, int32_t n) {
  std::vector<ShardInfo> out;
  const int64_t size = shape[dim];
  const int64_t piece = (size + n - 1) / n;
  for (int32_t r = 0; r < n && r * piece < size; ++r) {
    ShardInfo s{r, Shape(shape.size(), 0), shape, "", 0};
    s.offset[dim] = r * piece;
    s.shape[dim] = std::min(piece, size - r * piece);
    out.push_back(s);
  }
  return out;
}

std::vector<ShardInfo> ReplicaShards(const Shape& shape, int32_t n) {
  std::vector<ShardInfo> out;
  for (int32_t r = 0; r < n; ++r) out.push_back({r, Shape(shape.size(), 0), shape, "", 0});
  return out;
}

ShardInfo Shard(int32_t rank, Shape offset, Shape shape) { return ShardInfo{rank, std::move(offset), std::move(shape), "", 0}; }

World::World() : transport_(std::move(transport::CreateLocalTransport()).value()) {}

World::~World() {
  for (uint64_t id : registrations_) (void)transport_->Deregister(id);
}

void World::AddTensor(const std::string& name, DType dtype, const Shape& shape, std::vector<ShardInfo> shards) {
  const int64_t tag = static_cast<int64_t>(tags_.size()) + 1;
  tags_[name] = tag;
  const int64_t n = NumElements(shape);
  const size_t es = DTypeSize(dtype);
  std::vector<std::byte> bytes(static_cast<size_t>(n) * es);
  for (int64_t i = 0; i < n; ++i) {
    const double v = tag * 65536.0 + static_cast<double>(i);
    std::byte* e = bytes.data() + static_cast<size_t>(i) * es;
    switch (dtype) {
      case DType::kF32: { const float f = static_cast<float>(v); std::memcpy(e, &f, 4); break; }
      case DType::kI32: { const int32_t x = static_cast<int32_t>(v); std::memcpy(e, &x, 4); break; }
      case DType::kI64: { const int64_t x = static_cast<int64_t>(v); std::memcpy(e, &x, 8); break; }
      case DType::kBF16: { const uint16_t b = F32ToBf16Bits(static_cast<float>(v)); std::memcpy(e, &b, 2); break; }
      case DType::kF16: { const uint16_t h = F32ToF16Bits(static_cast<float>((tag * 64 + i) % 2048)); std::memcpy(e, &h, 2); break; }
      default: { const uint8_t b = static_cast<uint8_t>(tag * 31 + i); std::memcpy(e, &b, 1); break; }
    }
  }
  ShardTable t{name, dtype, shape, {}};
  std::vector<int32_t> id(shape.size());
  for (size_t d = 0; d < id.size(); ++d) id[d] = static_cast<int32_t>(d);
  for (ShardInfo& s : shards) {
    const Box box = s.box();
    auto sb = std::make_unique<std::vector<std::byte>>(static_cast<size_t>(box.numel()) * es);
    if (box.numel() > 0) {
      internal::CopyViewFromBlock(dtype, bytes.data(), FullBox(shape), box, id, dtype, sb->data(), 0,
                                  RowMajorStrides(box.extent));
    }
    auto reg = transport_->RegisterMemory({sb->data(), sb->size()});
    registrations_.push_back(reg->id);
    s.handle = reg->descriptor;
    s.digest = box.numel() > 0 ? DigestBlock(dtype, shape, box, sb->data()) : 0;
    shard_bytes_.push_back(std::move(sb));
    t.shards.push_back(std::move(s));
  }
  full_[name] = std::move(bytes);
  manifest_.tables.push_back(std::move(t));
}

std::vector<TensorSpec> World::Sources() const {
  std::vector<TensorSpec> out;
  for (const auto& t : manifest_.tables) out.push_back(t.spec());
  return out;
}

Result<RunResult> PlanAndRun(World& world, const std::vector<TensorSpec>& params, const Loader& loader,
                             const PlanOptions& options, const ExecuteOptions& exec) {
  RunResult rr;
  CaptureContext ctx(world.Sources(), params);
  RC_RETURN_IF_ERROR(loader(ctx));
  rr.capture = ctx.Take();
  RC_ASSIGN_OR_RETURN(rr.plan, BuildPlan(rr.capture, world.manifest(), options));
  DestinationBuffers bufs;
  for (const TensorSpec& p : params) {
    auto& v = rr.params[p.name];
    v.assign(p.bytes(), std::byte{0});
    bufs.emplace(p.name, std::span<std::byte>(v.data(), v.size()));
  }
  RC_ASSIGN_OR_RETURN(ExecuteStats stats, ExecutePlan(rr.plan, world.transport(), bufs, exec));
  (void)stats;
  return rr;
}

double ElementAt(DType dtype, const std::vector<std::byte>& bytes, int64_t i) {
  const std::byte* e = bytes.data() + static_cast<size_t>(i) * DTypeSize(dtype);
  switch (dtype) {
    case DType::kF32: { float f; std::memcpy(&f, e, 4); return f; }
    case DType::kBF16: { uint16_t b; std::memcpy(&b, e, 2); return Bf16BitsToF32(b); }
    case DType::kF16: { uint16_t h; std::memcpy(&h, e, 2); return F16BitsToF32(h); }
    case DType::kI32: { int32_t x; std::memcpy(&x, e, 4); return x; }
    case DType::kI64: { int64_t x; std::memcpy(&x, e, 8); return static_cast<double>(x); }
    default: { uint8_t b; std::memcpy(&b, e, 1); return b; }
  }
}

}  // namespace rc::refit::testing
