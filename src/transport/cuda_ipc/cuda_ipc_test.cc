// Unit tests of the cuda_ipc backend that need no GPU: descriptor format and parsing, and the
// refusals that happen before any CUDA call. GPU behaviour is tested in tests/gpu (label gpu).
#include <gtest/gtest.h>

#include <string>

#include "rolloutcore/transport/cuda_ipc.h"
#include "transport/cuda_ipc/cuda_ipc_descriptor.h"
#include "transport/descriptor_test_util.h"

namespace rc::transport {
namespace {

using cuda_ipc_internal::CudaIpcDescriptor;
using cuda_ipc_internal::FormatCudaIpcDescriptor;
using cuda_ipc_internal::ParseCudaIpcDescriptor;

CudaIpcDescriptor Sample() {
  CudaIpcDescriptor d;
  d.pid = 4242;
  d.id = 7;
  d.device = 1;
  d.offset = 4096;
  d.length = 1 << 20;
  for (size_t i = 0; i < d.handle.size(); ++i) d.handle[i] = static_cast<char>(i * 37 + 1);
  return d;
}

TEST(CudaIpcDescriptorTest, RoundTrips) {
  const CudaIpcDescriptor d = Sample();
  const std::string text = FormatCudaIpcDescriptor(d);
  EXPECT_EQ(text.rfind("cuda_ipc:v1:pid=4242:id=7:dev=1:off=4096:len=1048576:handle=", 0), 0u) << text;
  auto parsed = ParseCudaIpcDescriptor(text);
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  EXPECT_EQ(parsed->pid, d.pid);
  EXPECT_EQ(parsed->id, d.id);
  EXPECT_EQ(parsed->device, d.device);
  EXPECT_EQ(parsed->offset, d.offset);
  EXPECT_EQ(parsed->length, d.length);
  EXPECT_EQ(parsed->handle, d.handle);
}

void ExpectError(const std::string& text, const std::string& needle) {
  testing::ExpectParseErrors([](const std::string& t) { return ParseCudaIpcDescriptor(t); }, {{text, needle}});
}

TEST(CudaIpcDescriptorTest, ErrorsNameTheField) {
  const std::string good = FormatCudaIpcDescriptor(Sample());
  ExpectError("shm:v1:pid=1", "does not start with 'cuda_ipc:v1:'");
  ExpectError("cuda_ipc:v2:" + good.substr(12), "does not start with");
  std::string s = good;
  s.replace(s.find("pid=4242"), 8, "pid=x");
  ExpectError(s, "field 'pid'");
  s = good;
  s.replace(s.find("len="), 4, "size=");
  ExpectError(s, "unknown field 'size'");
  ExpectError(good + ":dev=2", "field 'dev' appears twice");
  s = good.substr(0, good.size() - 2);  // handle one byte short
  ExpectError(s, "field 'handle'");
  s = good;
  s.replace(s.find(":off=4096"), 9, "");
  ExpectError(s, "missing field 'off'");
  s = good;
  s.replace(s.find("off=4096"), 8, "off=18446744073709551615");
  ExpectError(s, "overflow");
  s = good;
  s.replace(s.find("id=7"), 4, "id=0");
  ExpectError(s, "field 'id'");
}

TEST(CudaIpcTransportTest, HostMemoryIsRefusedOrNoDevice) {
  auto t = CreateCudaIpcTransport();
  if (!t.ok()) {
    // No GPU here: the refusal names the reason.
    EXPECT_EQ(t.status().code(), StatusCode::kUnavailable);
    EXPECT_NE(t.status().message().find("no CUDA device"), std::string::npos) << t.status().message();
    return;
  }
  char buf[64];
  auto reg = (*t)->RegisterMemory({buf, sizeof buf, MemoryKind::kHost, -1});
  ASSERT_FALSE(reg.ok());
  EXPECT_EQ(reg.status().code(), StatusCode::kUnimplemented);
  auto bad = (*t)->Import("cuda_ipc:v1:pid=1:id=1");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace rc::transport
