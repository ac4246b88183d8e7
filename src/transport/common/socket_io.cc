#include "transport/common/socket_io.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <string>

namespace rc::transport::internal {

int64_t SteadyNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

Result<int> ConnectTcp(std::string_view host, uint16_t port, int64_t deadline_ns, std::string_view peer,
                       const std::function<Status()>& check) {
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(port);
  const std::string host_text(host);
  if (::inet_pton(AF_INET, host_text.c_str(), &sa.sin_addr) != 1) {
    return InvalidArgument(fmt::format("{}: host '{}' is not an IPv4 address", peer, host));
  }
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return Unavailable(fmt::format("{}: socket: {}", peer, std::strerror(errno)));
  struct Closer {
    int fd;
    bool keep = false;
    ~Closer() {
      if (!keep) ::close(fd);
    }
  } closer{fd};
  const int64_t start = SteadyNs();
  int r = ::connect(fd, reinterpret_cast<const sockaddr*>(&sa), sizeof sa);
  if (r != 0 && errno != EINPROGRESS && errno != EINTR) {
    return Unavailable(fmt::format("{}: connect to {}:{}: {} (owner gone or its transport closed?)", peer, host, port,
                                   std::strerror(errno)));
  }
  while (r != 0) {
    pollfd pfd{fd, POLLOUT, 0};
    const int64_t left_ms = (deadline_ns - SteadyNs()) / 1'000'000;
    const int pr = ::poll(&pfd, 1, static_cast<int>(std::clamp<int64_t>(left_ms, 0, 20)));
    if (pr < 0 && errno != EINTR) return Unavailable(fmt::format("{}: poll: {}", peer, std::strerror(errno)));
    if (pr > 0) {
      int err = 0;
      socklen_t len = sizeof err;
      if (::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = errno;
      if (err != 0) {
        return Unavailable(fmt::format("{}: connect to {}:{}: {} (owner gone or its transport closed?)", peer, host,
                                       port, std::strerror(err)));
      }
      r = 0;
      break;
    }
    if (check) RC_RETURN_IF_ERROR(check());
    if (SteadyNs() >= deadline_ns) {
      return DeadlineExceeded(fmt::format("{}: TCP connect to {}:{} not established after {} ms (the deadline)", peer,
                                          host, port, (SteadyNs() - start) / 1'000'000));
    }
  }
  // Back to blocking mode: the callers poll before every receive themselves.
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0) {
    return Unavailable(fmt::format("{}: fcntl: {}", peer, std::strerror(errno)));
  }
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  closer.keep = true;
  return fd;
}

Status SendAll(int fd, const void* data, size_t n) {
  const auto* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::send(fd, p, n, MSG_NOSIGNAL);
    if (w < 0) {
      if (errno == EINTR) continue;
      return Unavailable(fmt::format("control connection: send: {}", std::strerror(errno)));
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
  return OkStatus();
}

Status RecvAll(int fd, void* data, size_t n, int64_t deadline_ns, const std::function<Status()>& check) {
  auto* p = static_cast<char*>(data);
  while (n > 0) {
    pollfd pfd{fd, POLLIN, 0};
    const int pr = ::poll(&pfd, 1, 20);
    if (pr < 0 && errno != EINTR) return Unavailable(fmt::format("control connection: poll: {}", std::strerror(errno)));
    if (pr > 0) {
      const ssize_t r = ::recv(fd, p, n, 0);
      if (r == 0) return Unavailable("control connection closed by the peer");
      if (r < 0) {
        if (errno == EINTR || errno == EAGAIN) continue;
        return Unavailable(fmt::format("control connection: recv: {}", std::strerror(errno)));
      }
      p += r;
      n -= static_cast<size_t>(r);
      continue;
    }
    if (check) RC_RETURN_IF_ERROR(check());
    if (SteadyNs() >= deadline_ns) return DeadlineExceeded("no answer on the control connection before the deadline");
  }
  return OkStatus();
}

bool ConnectionClosed(int fd) {
  char c;
  const ssize_t r = ::recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
  if (r == 0) return true;
  return r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR;
}

}  // namespace rc::transport::internal
