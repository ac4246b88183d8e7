#include "directory/codec.h"

#include <gtest/gtest.h>

#include "directory/etcd_client.h"
#include "directory/test_util.h"

namespace rc::directory::internal {
namespace {

TEST(PublishBodyTest, RoundTrips) {
  PublishRequest r = testing::MakePublish("m", "v", 1, 2, 5000);
  auto back = ParsePublishBody(PublishBodyToJson(r).dump(), "m", "v", 1);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->expected_ranks, 2);
  EXPECT_EQ(back->lease_ttl_ms, 5000);
  ASSERT_EQ(back->tables.size(), 2u);
  EXPECT_EQ(back->tables[0].shards[0].digest, r.tables[0].shards[0].digest);
  EXPECT_EQ(back->tables[0].shards[0].handle, r.tables[0].shards[0].handle);
  r.lease_id = 9'007'199'254'740'993;  // above 2^53: must travel exactly
  back = ParsePublishBody(PublishBodyToJson(r).dump(), "m", "v", 1);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->lease_id, 9'007'199'254'740'993);
}

TEST(PublishBodyTest, BadInputNamesTheField) {
  auto msg = [](const std::string& body) { return ParsePublishBody(body, "m", "v", 0).status().message(); };
  EXPECT_NE(msg("{").find("request body is malformed"), std::string::npos);
  EXPECT_EQ(msg("[]"), "request body: expected a JSON object, got array");
  EXPECT_NE(msg(R"({"expected_ranks": 1, "lease_ttl_ms": 5, "tensors": [], "extra": 1})").find("extra"),
            std::string::npos);
  EXPECT_EQ(msg(R"({"lease_ttl_ms": 5, "tensors": []})"), "expected_ranks: required field is missing");
  EXPECT_EQ(msg(R"({"expected_ranks": "2", "lease_ttl_ms": 5, "tensors": []})"),
            "expected_ranks: expected an integer, got string");
  EXPECT_EQ(msg(R"({"expected_ranks": 0, "lease_ttl_ms": 5, "tensors": []})"),
            "expected_ranks: must be between 1 and 65536, got 0");
  EXPECT_EQ(msg(R"({"expected_ranks": 1, "lease_ttl_ms": 5})"), "tensors: required field is missing");
  EXPECT_EQ(msg(R"({"expected_ranks": 1, "lease_ttl_ms": 5, "lease_id": "x1", "tensors": []})"),
            "lease_id: expected a decimal integer, got 'x1'");
  EXPECT_NE(msg(R"({"expected_ranks": 1, "lease_ttl_ms": 5, "tensors": [{"name": "a", "dtype": "bogus",
               "shape": [2], "shards": []}]})")
                .find("tensors[0].dtype"),
            std::string::npos);
  EXPECT_NE(msg(std::string(100, '[') + std::string(100, ']')).find("nested deeper than 64"), std::string::npos);
  EXPECT_EQ(msg(R"({"expected_ranks": 1, "lease_ttl_ms": 5, "tensors": []})"),
            "digest: required field is missing: rank 0 must say which content digest its shard digests use (this "
            "directory accepts \"rc-digest-2\"); a publisher that does not say predates it");
  EXPECT_EQ(msg(R"({"expected_ranks": 1, "lease_ttl_ms": 5, "digest": "rc-digest-1", "tensors": []})"),
            "digest: rank 0 computed its shard digests with \"rc-digest-1\", but this directory accepts only "
            "\"rc-digest-2\" (publisher and engine must be built from the same rolloutcore release)");
  EXPECT_EQ(msg(R"({"expected_ranks": 1, "lease_ttl_ms": 5, "digest": 2, "tensors": []})"),
            "digest: expected a string, got integer");
  EXPECT_TRUE(
      ParsePublishBody(R"({"expected_ranks": 1, "lease_ttl_ms": 5, "digest": "rc-digest-2", "tensors": []})", "m", "v", 0)
          .ok());
}

TEST(CodecTest, VersionInfoAndCommitEventRoundTrip) {
  VersionInfo v;
  v.model = "m";
  v.version = "v";
  v.state = VersionState::kAbandoned;
  v.expected_ranks = 3;
  v.published_ranks = {0, 2};
  v.content_digest = 0xFEDCBA9876543210ULL;
  v.reason = "why";
  auto back = VersionInfoFromJson(VersionInfoToJson(v), "");
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->state, v.state);
  EXPECT_EQ(back->published_ranks, v.published_ranks);
  EXPECT_EQ(back->content_digest, v.content_digest);
  EXPECT_EQ(back->reason, "why");
  CommitEvent e{"m", "v", 7, 0xFFFFFFFFFFFFFFFFULL};
  auto eb = CommitEventFromJson(CommitEventToJson(e), "");
  ASSERT_TRUE(eb.ok());
  EXPECT_EQ(eb->seq, 7u);
  EXPECT_EQ(eb->content_digest, e.content_digest);
}

TEST(CodecTest, ErrorsMapToHttpAndBack) {
  const Status s = FailedPrecondition("version v of model m is already COMMITTED");
  EXPECT_EQ(HttpStatusFor(s), 409);
  EXPECT_EQ(HttpStatusFor(InvalidArgument("x")), 400);
  EXPECT_EQ(HttpStatusFor(NotFound("x")), 404);
  EXPECT_EQ(HttpStatusFor(Internal("x")), 500);
  EXPECT_EQ(StatusFromErrorJson(ErrorToJson(s), 409), s);
  EXPECT_EQ(StatusFromErrorJson(Json::array(), 502).code(), StatusCode::kInternal);
}

TEST(EtcdEncodingTest, Base64AndRangeEnd) {
  for (const std::string& s : {std::string(""), std::string("f"), std::string("fo"), std::string("foo"),
                        std::string("/rolloutcore/m/meta/v1"), std::string("\x00\xff\x10", 3)}) {
    auto back = Base64Decode(Base64Encode(s));
    ASSERT_TRUE(back.ok());
    EXPECT_EQ(*back, s);
  }
  EXPECT_EQ(Base64Encode("foo"), "Zm9v");
  EXPECT_EQ(Base64Encode("fo"), "Zm8=");
  EXPECT_EQ(PrefixRangeEnd("/a/"), "/a0");
  EXPECT_EQ(PrefixRangeEnd(std::string("a\xff", 2)), "b");
  EXPECT_FALSE(Base64Decode("Zm9v!").ok());
}

}  // namespace
}  // namespace rc::directory::internal
