#include "rolloutcore/engine/parameters.h"

namespace rc::engine {

std::string ShapeString(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

Status ParameterStore::Add(const std::string& name, std::vector<int64_t> shape) {
  if (params_.count(name) != 0) return AlreadyExists("parameter '" + name + "' already exists");
  Parameter p;
  p.name = name;
  p.numel = 1;
  for (int64_t d : shape) {
    if (d < 0) return InvalidArgument("parameter '" + name + "': negative dimension");
    p.numel *= d;
  }
  p.shape = std::move(shape);
  p.storage = std::shared_ptr<float[]>(new float[static_cast<size_t>(p.numel)]());
  params_.emplace(name, std::move(p));
  return OkStatus();
}

Status ParameterStore::Alias(const std::string& name, const std::string& target) {
  auto it = params_.find(target);
  if (it == params_.end()) return NotFound("parameter '" + target + "' to alias does not exist");
  Parameter p = it->second;
  p.name = name;
  p.alias_of = target;
  if (!params_.emplace(name, std::move(p)).second) {
    return AlreadyExists("parameter '" + name + "' already exists");
  }
  return OkStatus();
}

const Parameter* ParameterStore::Find(std::string_view name) const {
  auto it = params_.find(name);
  return it == params_.end() ? nullptr : &it->second;
}

Result<float*> ParameterStore::Get(std::string_view name, const std::vector<int64_t>& expect_shape) const {
  const Parameter* p = Find(name);
  if (p == nullptr) return NotFound("engine parameter '" + std::string(name) + "' does not exist");
  if (p->shape != expect_shape) {
    return InvalidArgument("engine parameter '" + std::string(name) + "' has shape " + ShapeString(p->shape) +
                           ", expected " + ShapeString(expect_shape));
  }
  return p->data();
}

int64_t ParameterStore::TotalBytes() const {
  int64_t n = 0;
  for (const auto& [name, p] : params_)
    if (p.alias_of.empty()) n += static_cast<int64_t>(p.nbytes());
  return n;
}

}  // namespace rc::engine
