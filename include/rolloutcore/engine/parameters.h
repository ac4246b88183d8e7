// ParameterStore: one tensor-parallel rank's live engine parameters (f32, row-major), by name.
//
// This is the surface refit installs into and digests from: name -> (pointer, shape, dtype).
// The set of names and shapes is fixed when the engine is built (from the loader's
// parameter list) and never changes; only bytes change, and only through the engine's
// install path while it is paused (Engine::InstallWeights). With tied embeddings
// lm_head.weight shares storage with model.embed_tokens.weight (Alias).
//
// Thread safety: not synchronized. The engine reads parameters only inside Step(); writers
// must hold the engine paused (the engine enforces this for its own install path).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "rolloutcore/base/status.h"
#include "rolloutcore/engine/safetensors.h"

namespace rc::engine {

struct Parameter {
  std::string name;
  std::vector<int64_t> shape;
  DType dtype = DType::kF32;  // always F32 in memory
  int64_t numel = 0;
  std::shared_ptr<float[]> storage;
  std::string alias_of;  // non-empty: shares storage with that parameter
  float* data() const { return storage.get(); }
  size_t nbytes() const { return static_cast<size_t>(numel) * sizeof(float); }
};

class ParameterStore {
 public:
  // Allocates a zero-filled parameter; AlreadyExists for a duplicate name.
  Status Add(const std::string& name, std::vector<int64_t> shape);
  // Makes `name` share `target`'s storage (same shape required).
  Status Alias(const std::string& name, const std::string& target);
  const Parameter* Find(std::string_view name) const;
  // NotFound naming the parameter; InvalidArgument when the shape differs.
  Result<float*> Get(std::string_view name, const std::vector<int64_t>& expect_shape) const;
  const std::map<std::string, Parameter, std::less<>>& all() const { return params_; }
  int64_t TotalBytes() const;  // counts aliased storage once

 private:
  std::map<std::string, Parameter, std::less<>> params_;
};

std::string ShapeString(const std::vector<int64_t>& shape);

}  // namespace rc::engine
