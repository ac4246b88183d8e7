// Owner-side bookkeeping of the shm transport, one per process: the live ShmBuffers (address
// range -> memfd), the control memfd whose words say which registrations are live, and the
// registrations themselves.
//
// Thread safety: every method may be called from any thread; state is guarded by one mutex.
// Invariants: a registration lies entirely inside one live ShmBuffer; its control word equals its
// generation exactly while it is registered (generations are never reused within a process, so
// a reused slot is told apart from the old one); destroying a buffer clears the words of every
// registration inside it before the memory is unmapped.
// A child created with fork() (no exec) must not register its parent's buffers: the control
// memfd is shared with the parent. fork+exec children start clean.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "rolloutcore/base/status.h"
#include "transport/shm/shm_descriptor.h"

namespace rc::transport::shm_internal {

struct OwnerRegistration {
  uint64_t id = 0;
  ShmDescriptor descriptor;
};

// Random 64-bit token (never 0).
uint64_t RandomToken();
// Name of the memfd for a buffer (or control block) with this token, as memfd_create is given it.
std::string BufferMemfdName(uint64_t token);
std::string ControlMemfdName(uint64_t token);

constexpr uint32_t kControlSlots = 1u << 16;  // registrations live at once, per process

void AddBuffer(std::byte* base, uint64_t size, int fd, uint64_t token);
void RemoveBuffer(std::byte* base);
[[nodiscard]] Result<OwnerRegistration> Register(const void* addr, uint64_t length);
[[nodiscard]] Status Deregister(uint64_t id);

}  // namespace rc::transport::shm_internal
