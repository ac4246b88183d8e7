// The one "find the transport in the manifest, create it, cache its imports" step of the refit
// receiver (docs/architecture.md, module `receiver`), shared by every path that pulls or serves a
// version's bytes: the full stage (receiver.cc), the delta stage (delta_apply.cc), the relay
// (relay.cc) and the device receiver of vLLM's GPU parameters (device_receiver.cc).
//
// CreateManifestTransport: the transport the manifest's shard handles name
// (refit::ManifestTransport), created through the backend registry.
//
// SourceImports: that transport plus the source descriptors imported through it
// (refit::ImportCache), kept while the transport name and the caller's topology key are
// unchanged. The imports are always released before the transport they came from (on Reset, on
// replacement, on destruction, and when one SourceImports is moved onto another).
//
// Thread safety: none; one owner (the receiver holds it under its mutex).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "rolloutcore/base/status.h"
#include "rolloutcore/refit/executor.h"
#include "rolloutcore/refit/manifest.h"
#include "rolloutcore/transport/transport.h"

namespace rc::receiver {

// The transport `manifest`'s sources use, created with `options`; *name (when non-null) is set to
// its name. InvalidArgument when the manifest names none or several; the registry's error when
// the backend is not built.
[[nodiscard]] Result<std::unique_ptr<transport::Transport>> CreateManifestTransport(
    const refit::Manifest& manifest, const transport::TransportOptions& options = {}, std::string* name = nullptr);

class SourceImports {
 public:
  SourceImports() = default;
  ~SourceImports() { Reset(); }
  SourceImports(SourceImports&& other) noexcept;
  SourceImports& operator=(SourceImports&& other) noexcept;
  SourceImports(const SourceImports&) = delete;
  SourceImports& operator=(const SourceImports&) = delete;

  // True when a transport named `name` is held with its import cache for `topology`.
  bool Holds(std::string_view name, uint64_t topology) const;
  // Replaces whatever is held (imports released first) with a new transport `name` and an empty
  // import cache for `topology`. On error nothing is held.
  [[nodiscard]] Status Create(std::string_view name, uint64_t topology, const transport::TransportOptions& options = {});
  // The manifest's transport for `topology`: kept when Holds(), created otherwise. Returns whether
  // it was kept (the imports cached).
  [[nodiscard]] Result<bool> Ensure(const refit::Manifest& manifest, uint64_t topology,
                                    const transport::TransportOptions& options = {});
  // Releases the imports, then the transport.
  void Reset();

  bool ready() const { return transport_ != nullptr && imports_ != nullptr; }
  // Only while ready().
  transport::Transport& transport() { return *transport_; }
  refit::ImportCache& imports() { return *imports_; }
  const std::string& transport_name() const { return name_; }

 private:
  std::unique_ptr<transport::Transport> transport_;
  std::unique_ptr<refit::ImportCache> imports_;  // declared after transport_: destroyed first
  std::string name_;
  uint64_t topology_ = 0;
};

}  // namespace rc::receiver
