// Unit tests of the nccl backend that need no GPU: descriptor format and parsing, and creation
// without a device. GPU behaviour is tested in tests/gpu (label gpu).
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "rolloutcore/transport/nccl.h"
#include "transport/nccl/nccl_descriptor.h"
#include "transport/descriptor_test_util.h"

namespace rc::transport {
namespace {

using nccl_internal::FormatNcclDescriptor;
using nccl_internal::NcclDescriptor;
using nccl_internal::ParseNcclDescriptor;

NcclDescriptor Sample() {
  NcclDescriptor d;
  d.host = "127.0.0.1";
  d.port = 40123;
  d.pid = 99;
  d.token = 0x0123456789abcdefULL;
  d.id = 3;
  d.device = 0;
  d.length = 12345;
  return d;
}

TEST(NcclDescriptorTest, RoundTrips) {
  const std::string text = FormatNcclDescriptor(Sample());
  EXPECT_EQ(text, "nccl:v1:host=127.0.0.1:port=40123:pid=99:tok=0123456789abcdef:id=3:dev=0:len=12345");
  auto d = ParseNcclDescriptor(text);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->host, "127.0.0.1");
  EXPECT_EQ(d->port, 40123);
  EXPECT_EQ(d->pid, 99);
  EXPECT_EQ(d->token, 0x0123456789abcdefULL);
  EXPECT_EQ(d->id, 3u);
  EXPECT_EQ(d->length, 12345u);
}

void ExpectError(const std::string& text, const std::string& needle) {
  testing::ExpectParseErrors([](const std::string& t) { return ParseNcclDescriptor(t); }, {{text, needle}});
}

TEST(NcclDescriptorTest, ErrorsNameTheField) {
  const std::string good = FormatNcclDescriptor(Sample());
  ExpectError("cuda_ipc:v1:pid=1", "does not start with 'nccl:v1:'");
  std::string s = good;
  s.replace(s.find("port=40123"), 10, "port=70000");
  ExpectError(s, "field 'port'");
  s = good;
  s.replace(s.find("tok=0123456789abcdef"), 20, "tok=12");
  ExpectError(s, "field 'tok'");
  s = good;
  s.replace(s.find("host=127.0.0.1"), 14, "host=");
  ExpectError(s, "field 'host'");
  ExpectError(good + ":color=red", "unknown field 'color'");
  s = good;
  s.replace(s.find(":len=12345"), 10, "");
  ExpectError(s, "missing field 'len'");
}

TEST(NcclTransportTest, CreationForcesNvlsOffAndNeedsADevice) {
  ::setenv("NCCL_NVLS_ENABLE", "1", 1);
  auto t = CreateNcclTransport();
  EXPECT_STREQ(std::getenv("NCCL_NVLS_ENABLE"), "0");
  if (!t.ok()) {
    EXPECT_EQ(t.status().code(), StatusCode::kUnavailable);
    EXPECT_NE(t.status().message().find("no CUDA device"), std::string::npos) << t.status().message();
    return;
  }
  char buf[64];
  auto reg = (*t)->RegisterMemory({buf, sizeof buf, MemoryKind::kHost, -1});
  ASSERT_FALSE(reg.ok());
  EXPECT_EQ(reg.status().code(), StatusCode::kUnimplemented);
}

}  // namespace
}  // namespace rc::transport
