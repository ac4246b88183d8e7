// The `local` transport: reader and owner live in the same process; a read is a memcpy.
//
// Registrations go into one process-wide table shared by every LocalTransport instance (a trainer
// rank's instance and an engine rank's instance in one test process see each other's regions).
// Descriptors look like "local:v1:<pid>:<id>:<length>"; importing one from another process fails
// with Unavailable. Reads are performed synchronously inside PostReads, after every op of the batch
// was checked against its region (so a bad op fails the whole batch before any byte moves); the
// returned Transfer is therefore already done or failed, and Cancel() has nothing left to stop.
//
// Thread safety: all methods may be called concurrently; the region table is guarded by a mutex.
// A read holds the lock while copying, so Deregister waits for in-flight reads of the process.
#pragma once

#include <memory>

#include "rolloutcore/transport/transport.h"

namespace rc::transport {

[[nodiscard]] Result<std::unique_ptr<Transport>> CreateLocalTransport(const TransportOptions& options = {});

}  // namespace rc::transport
