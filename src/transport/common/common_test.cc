// Tests of what the transport backends share: the descriptor codec, the Transfer base classes'
// deadline handling, and the deadline-bounded control sockets (no GPU needed: the nccl backend's
// Import connects through ConnectTcp).
#include <arpa/inet.h>
#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <thread>
#include <vector>

#include "transport/common/descriptor_codec.h"
#include "transport/common/process.h"
#include "transport/common/socket_io.h"
#include "transport/common/transfer_base.h"

namespace rc::transport::internal {
namespace {

using codec::DescriptorFields;
using ::testing::HasSubstr;

constexpr std::array<std::string_view, 3> kNames = {"a", "b", "h"};

TEST(DescriptorCodecTest, ParsesEveryFieldOnceAndNamesTheBadOne) {
  auto f = DescriptorFields::Parse("demo", "demo:v1:", "demo:v1:h=00ff:b=7:a=x", kNames);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ(f->value(0), "x");
  EXPECT_EQ(*f->Number(1, 10, 1, 9), 7u);
  EXPECT_EQ(*f->Bytes(2), std::string("\x00\xff", 2));
  EXPECT_THAT(f->Number(1, 10, 8, 9).status().message(), HasSubstr("field 'b': 7 is out of range [8, 9]"));
  EXPECT_THAT(f->Number(0, 10, 0, 9).status().message(), HasSubstr("field 'a': 'x' is not a decimal number"));
  EXPECT_THAT(f->Number(2, 16, 0, UINT64_MAX, 16).status().message(), HasSubstr("'00ff' is not 16 hex digits"));
  struct Case {
    std::string text, needle;
  };
  for (const Case& c : std::vector<Case>{
           {"other:v1:a=1:b=2:h=00", "demo descriptor 'other:v1:a=1:b=2:h=00': does not start with 'demo:v1:'"},
           {"demo:v1:a=1:b=2", "missing field 'h'"},
           {"demo:v1:a=1:a=1:b=2:h=00", "field 'a' appears twice"},
           {"demo:v1:a=1:b=2:h=00:z=3", "unknown field 'z'"},
           {"demo:v1:a=1:b:h=00", "item 'b' is not key=value"},
       }) {
    auto p = DescriptorFields::Parse("demo", "demo:v1:", c.text, kNames);
    ASSERT_FALSE(p.ok()) << c.text;
    EXPECT_EQ(p.status().code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(p.status().message(), HasSubstr(c.needle));
  }
  // Long texts are abbreviated in messages.
  const std::string longer = "demo:v1:a=" + std::string(200, '1');
  EXPECT_THAT(DescriptorFields::Parse("demo", "demo:v1:", longer, kNames).status().message(),
              HasSubstr("...(210 chars)"));
}

TEST(DescriptorCodecTest, HexRoundTripsAndRefusesBadDigits) {
  const std::string bytes("\x00\x01\xab\xff", 4);
  EXPECT_EQ(codec::HexEncode(bytes), "0001abff");
  std::string back;
  ASSERT_TRUE(codec::HexDecode("0001ABff", &back));
  EXPECT_EQ(back, bytes);
  EXPECT_FALSE(codec::HexDecode("abc", &back));
  EXPECT_FALSE(codec::HexDecode("zz", &back));
  std::array<char, 2> fixed{};
  EXPECT_TRUE(codec::HexDecode("0aff", fixed.data(), 2));
  EXPECT_FALSE(codec::HexDecode("0aff00", fixed.data(), 2));
}

// A transfer that completes when its test says so: exercises the base classes' Wait/Poll logic.
class GatedTransfer final : public RecordedTransfer {
 public:
  GatedTransfer(Clock& clock, std::atomic<int>* outcome) : RecordedTransfer(clock, 42), outcome_(outcome) {}
  void Cancel() override {}
  int polls = 0;

 private:
  TransferState PollPending() override {
    ++polls;
    const int o = outcome_->load();
    if (o == 1) return Finish(TransferState::kDone, OkStatus());
    if (o == 2) return Finish(TransferState::kFailed, Unavailable("peer died"));
    return TransferState::kPending;
  }
  std::string PendingAtDeadline() const override { return "gated transfer of 42 bytes still pending"; }
  std::atomic<int>* outcome_;
};

TEST(TransferBaseTest, WaitHonoursTheTransportClockAndRecordsTheOutcomeOnce) {
  ManualClock clock(1'000'000'000);
  std::atomic<int> outcome{0};
  GatedTransfer t(clock, &outcome);
  EXPECT_EQ(t.Poll(), TransferState::kPending);
  EXPECT_EQ(t.status().code(), StatusCode::kUnavailable);
  // The deadline has passed on the transport's clock: Wait returns at once, still pending.
  Status s = t.Wait(clock.NowNs());
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded);
  EXPECT_THAT(s.message(), HasSubstr("gated transfer of 42 bytes still pending"));
  // A deadline that a test clock reaches while Wait runs is noticed within a slice.
  std::thread advance([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    clock.Advance(2'000'000'000);
  });
  const auto start = std::chrono::steady_clock::now();
  s = t.Wait(clock.NowNs() + 1'000'000'000);
  advance.join();
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(2));
  outcome = 2;
  EXPECT_EQ(t.Wait(INT64_MAX).code(), StatusCode::kUnavailable);
  const int polls = t.polls;
  outcome = 1;  // the outcome is recorded: later changes are not seen
  EXPECT_EQ(t.Poll(), TransferState::kFailed);
  EXPECT_EQ(t.status().message(), "peer died");
  EXPECT_EQ(t.polls, polls);
  EXPECT_EQ(t.bytes(), 42u);
}

TEST(TransferBaseTest, CheckReadOpRefusesOutOfRangeAndNullDestination) {
  std::byte dst[8];
  EXPECT_TRUE(CheckReadOp(0, ReadOp{{1, 16}, 8, dst, 8}, 16, [] { return "region r"; }).ok());
  EXPECT_TRUE(CheckReadOp(0, ReadOp{{1, 16}, 16, nullptr, 0}, 16, [] { return "region r"; }).ok());
  Status s = CheckReadOp(3, ReadOp{{1, 16}, 9, dst, 8}, 16, [] { return "region r"; });
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "read 3 of batch: bytes 9..17 outside region r of 16 bytes");
  s = CheckReadOp(1, ReadOp{{1, 16}, UINT64_MAX, dst, 2}, 16, [] { return "region r"; });
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  s = CheckReadOp(2, ReadOp{{1, 16}, 0, nullptr, 4}, 16, [] { return "region r"; });
  EXPECT_EQ(s.message(), "read 2 of batch: null destination for 4 bytes");
}

// A listening socket on 127.0.0.1 with an ephemeral port.
struct Listener {
  int fd = -1;
  uint16_t port = 0;
  explicit Listener(int backlog) {
    fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa), 0);
    EXPECT_EQ(::listen(fd, backlog), 0);
    socklen_t len = sizeof sa;
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len);
    port = ntohs(sa.sin_port);
  }
  ~Listener() { ::close(fd); }
};

TEST(SocketIoTest, ConnectsAndExchangesBytesUnderADeadline) {
  Listener l(4);
  auto fd = ConnectTcp("127.0.0.1", l.port, SteadyNs() + 5'000'000'000, "owner test");
  ASSERT_TRUE(fd.ok()) << fd.status().ToString();
  const int server = ::accept(l.fd, nullptr, nullptr);
  ASSERT_GE(server, 0);
  ASSERT_TRUE(SendAll(server, "hello", 5).ok());
  char buf[5];
  ASSERT_TRUE(RecvAll(*fd, buf, 5, SteadyNs() + 1'000'000'000, {}).ok());
  EXPECT_EQ(std::string(buf, 5), "hello");
  // Nothing more comes: the receive ends at its deadline.
  const auto start = std::chrono::steady_clock::now();
  Status s = RecvAll(*fd, buf, 1, SteadyNs() + 100'000'000, {});
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(2));
  EXPECT_FALSE(ConnectionClosed(*fd));
  ::close(server);
  EXPECT_EQ(RecvAll(*fd, buf, 1, SteadyNs() + 1'000'000'000, {}).code(), StatusCode::kUnavailable);
  EXPECT_TRUE(ConnectionClosed(*fd));
  ::close(*fd);
}

TEST(SocketIoTest, ConnectToAClosedPortIsUnavailableNamingThePeer) {
  uint16_t port = 0;
  {
    Listener l(1);
    port = l.port;
  }  // closed: nothing listens there now
  auto fd = ConnectTcp("127.0.0.1", port, SteadyNs() + 5'000'000'000, "owner pid 7 at 127.0.0.1");
  ASSERT_FALSE(fd.ok());
  EXPECT_EQ(fd.status().code(), StatusCode::kUnavailable);
  EXPECT_THAT(fd.status().message(), HasSubstr("owner pid 7 at 127.0.0.1: connect to 127.0.0.1:"));
  EXPECT_EQ(ConnectTcp("not-an-ip", 1, SteadyNs() + 1'000'000'000, "owner x").status().code(),
            StatusCode::kInvalidArgument);
}

// The case the blocking connect(2) of the old nccl Import could not bound: a peer that never
// completes the handshake (here: a listener whose accept queue is full, so its kernel drops our
// SYNs). ConnectTcp gives up at the deadline with DeadlineExceeded naming the peer.
TEST(SocketIoTest, ConnectThatNeverCompletesEndsAtTheDeadline) {
  Listener l(0);
  std::vector<int> fillers;
  for (int i = 0; i < 8; ++i) {
    const int f = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_port = htons(l.port);
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    (void)::connect(f, reinterpret_cast<sockaddr*>(&sa), sizeof sa);
    fillers.push_back(f);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  const auto start = std::chrono::steady_clock::now();
  auto fd = ConnectTcp("127.0.0.1", l.port, SteadyNs() + 300'000'000, "owner pid 9 at 127.0.0.1:1");
  const auto took = std::chrono::steady_clock::now() - start;
  // `check` ends such an attempt early, with its own status.
  auto aborted = ConnectTcp("127.0.0.1", l.port, SteadyNs() + 10'000'000'000, "owner y",
                            [] { return Aborted("transport shutting down"); });
  for (int f : fillers) ::close(f);
  ASSERT_FALSE(fd.ok()) << "connected although the accept queue was full";
  EXPECT_EQ(fd.status().code(), StatusCode::kDeadlineExceeded) << fd.status().ToString();
  EXPECT_THAT(fd.status().message(), HasSubstr("owner pid 9 at 127.0.0.1:1: TCP connect to 127.0.0.1:"));
  EXPECT_GE(took, std::chrono::milliseconds(250));
  EXPECT_LT(took, std::chrono::seconds(3));
  ASSERT_FALSE(aborted.ok());
  EXPECT_EQ(aborted.status().code(), StatusCode::kAborted);
}

TEST(ProcessTest, GoneForAReapedChildAndAZombie) {
  EXPECT_FALSE(ProcessGone(::getpid()));
  EXPECT_FALSE(ProcessGone(0));
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  ASSERT_GT(child, 0);
  // Not yet reaped: a zombie once it has exited.
  for (int i = 0; i < 200 && !ProcessGone(child); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  EXPECT_TRUE(ProcessGone(child));
  int status = 0;
  ::waitpid(child, &status, 0);
  EXPECT_TRUE(ProcessGone(child));
}

}  // namespace
}  // namespace rc::transport::internal
