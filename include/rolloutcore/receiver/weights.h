// The weight storage of the refit receiver module (docs/architecture.md): what a staged image is
// made of and what the live weights an engine serves are kept in. The embedded engine keeps its
// parameters in these types (rolloutcore/engine/parameters.h names them in rc::engine).
//
// ParameterStore: one tensor-parallel rank's live engine parameters (row-major), by name, each
// kept in the dtype the weights were published in: BF16 for a bf16 checkpoint, dummy weights or a
// bf16-published refit, F32 for an f32 checkpoint. (An F16 checkpoint is widened to F32 at load,
// as before: the kernels read f32 and bf16 weights only.) The kernels widen bf16 in registers
// (bf16 -> f32 is exact: the bits shifted left by 16), so results are bitwise those of the f32
// path over the widened weights, with half the memory and half the bytes read per decode step.
//
// This is the surface refit installs into and digests from: name -> (bytes, shape, dtype).
// The set of names, shapes and the dtype is fixed when the engine is built (from the loader's
// parameter list) and never changes; only bytes change, and only through the engine's install
// path while it is paused (Engine::InstallWeights). With tied embeddings lm_head.weight shares
// storage with model.embed_tokens.weight (Alias); ExchangeStorage keeps the alias pointing at
// the same storage as its target.
//
// Storage is a WeightBuffer: page-aligned anonymous memory that can be made read-only
// (mprotect), so that the refit receiver can prove a staged image cannot change between its
// digest and the moment it is swapped in as the live weights (docs/refit.md "Install by swap").
//
// Thread safety: not synchronized. The engine reads parameters only inside Step(); writers
// must hold the engine paused (the engine enforces this for its own install path).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "rolloutcore/base/status.h"
#include "rolloutcore/formats/safetensors.h"

namespace rc::receiver {

using formats::DType;
using formats::DTypeSize;

// Page-aligned, zero-filled anonymous memory (mmap), released on destruction; buffers of 2 MiB or
// more are 2 MiB aligned with MADV_HUGEPAGE (ROLLOUTCORE_WEIGHT_HUGEPAGES=0: small pages), which
// makes a protection change of a 1.2 GB model ~0.1 ms instead of ~30 ms. SetReadOnly
// flips the protection of the whole buffer (PROT_READ vs PROT_READ|PROT_WRITE); a write into a
// read-only buffer faults (SIGSEGV) instead of silently changing bytes someone digested.
// Thread safety: none; the owner serializes protection changes with the writes they allow.
class WeightBuffer {
 public:
  // Internal (naming the size) when the memory cannot be mapped.
  static Result<std::shared_ptr<WeightBuffer>> Allocate(size_t bytes);
  ~WeightBuffer();
  WeightBuffer(const WeightBuffer&) = delete;
  WeightBuffer& operator=(const WeightBuffer&) = delete;

  std::byte* data() const { return data_; }
  size_t size() const { return size_; }
  bool read_only() const { return read_only_; }
  // Internal when mprotect fails (the protection is then unchanged).
  [[nodiscard]] Status SetReadOnly(bool read_only);

 private:
  WeightBuffer(std::byte* data, size_t size, size_t mapped) : data_(data), size_(size), mapped_(mapped) {}
  std::byte* data_;
  size_t size_;    // bytes asked for
  size_t mapped_;  // size_ rounded up to whole pages (at least one)
  bool read_only_ = false;
};

// True for the dtypes a parameter can be kept in (F32, BF16).
bool IsParameterDType(DType dtype);

struct Parameter {
  std::string name;
  std::vector<int64_t> shape;
  DType dtype = DType::kF32;  // kF32 or kBF16
  int64_t numel = 0;
  std::shared_ptr<WeightBuffer> storage;
  std::string alias_of;  // non-empty: shares storage with that parameter
  std::byte* bytes() const { return storage->data(); }
  size_t nbytes() const { return static_cast<size_t>(numel) * DTypeSize(dtype); }
  // The f32 / bf16 view; nullptr when the parameter has the other dtype.
  float* f32() const { return dtype == DType::kF32 ? reinterpret_cast<float*>(storage->data()) : nullptr; }
  uint16_t* bf16() const { return dtype == DType::kBF16 ? reinterpret_cast<uint16_t*>(storage->data()) : nullptr; }
};

class ParameterStore {
 public:
  // Allocates a zero-filled parameter of `dtype` (F32 or BF16); AlreadyExists for a duplicate
  // name, InvalidArgument for another dtype.
  Status Add(const std::string& name, std::vector<int64_t> shape, DType dtype = DType::kF32);
  // Makes `name` share `target`'s storage (same shape required).
  Status Alias(const std::string& name, const std::string& target);
  const Parameter* Find(std::string_view name) const;
  // NotFound naming the parameter; InvalidArgument when the shape differs.
  Result<const Parameter*> Get(std::string_view name, const std::vector<int64_t>& expect_shape) const;
  const std::map<std::string, Parameter, std::less<>>& all() const { return params_; }
  int64_t TotalBytes() const;  // counts aliased storage once
  // Exchanges the storage of `name` (not an alias) with *other, which must be a buffer of the
  // same size; every alias of `name` follows. InvalidArgument (nothing exchanged) otherwise.
  Status ExchangeStorage(std::string_view name, std::shared_ptr<WeightBuffer>* other);
  // Sets the protection of every storage (aliases share theirs).
  [[nodiscard]] Status SetReadOnly(bool read_only);

 private:
  std::map<std::string, Parameter, std::less<>> params_;
};

std::string ShapeString(const std::vector<int64_t>& shape);

// A set of weights in the engine layout outside the live ParameterStores (a staged refit image):
// per rank, parameter name -> its bytes in the live dtype and size. Aliases (a tied lm_head) may
// be absent; they follow their target. Borrowed: the owner keeps the bytes alive and unchanged
// while a consumer (LiveWeights::PreReplay) reads them.
using WeightImage = std::vector<std::map<std::string, std::span<const std::byte>>>;

}  // namespace rc::receiver
