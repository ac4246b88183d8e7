#include "rolloutcore/receiver/source_imports.h"

#include <utility>

#include "rolloutcore/transport/registry.h"

namespace rc::receiver {

Result<std::unique_ptr<transport::Transport>> CreateManifestTransport(const refit::Manifest& manifest,
                                                                      const transport::TransportOptions& options,
                                                                      std::string* name) {
  RC_ASSIGN_OR_RETURN(std::string transport_name, refit::ManifestTransport(manifest));
  RC_ASSIGN_OR_RETURN(auto transport, transport::CreateTransport(transport_name, options));
  if (name != nullptr) *name = std::move(transport_name);
  return transport;
}

SourceImports::SourceImports(SourceImports&& other) noexcept
    : transport_(std::move(other.transport_)),
      imports_(std::move(other.imports_)),
      name_(std::move(other.name_)),
      topology_(other.topology_) {}

SourceImports& SourceImports::operator=(SourceImports&& other) noexcept {
  if (this != &other) {
    Reset();
    transport_ = std::move(other.transport_);
    imports_ = std::move(other.imports_);
    name_ = std::move(other.name_);
    topology_ = other.topology_;
  }
  return *this;
}

bool SourceImports::Holds(std::string_view name, uint64_t topology) const {
  return ready() && name_ == name && topology_ == topology;
}

Status SourceImports::Create(std::string_view name, uint64_t topology, const transport::TransportOptions& options) {
  Reset();
  RC_ASSIGN_OR_RETURN(transport_, transport::CreateTransport(name, options));
  imports_ = std::make_unique<refit::ImportCache>(*transport_);
  name_ = std::string(name);
  topology_ = topology;
  return OkStatus();
}

Result<bool> SourceImports::Ensure(const refit::Manifest& manifest, uint64_t topology,
                                   const transport::TransportOptions& options) {
  RC_ASSIGN_OR_RETURN(std::string name, refit::ManifestTransport(manifest));
  if (Holds(name, topology)) return true;
  RC_RETURN_IF_ERROR(Create(name, topology, options));
  return false;
}

void SourceImports::Reset() {
  imports_.reset();  // released through the transport, before it goes
  transport_.reset();
}

}  // namespace rc::receiver
