// The shared loop of the backends' descriptor tests (shm, ucx): each case is a text the parser must
// refuse with InvalidArgument and a needle the message must contain (the field it names).
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "rolloutcore/base/status.h"

namespace rc::transport::testing {

struct ParseErrorCase {
  std::string text;
  std::string needle;
};

template <typename Parse>
void ExpectParseErrors(Parse&& parse, const std::vector<ParseErrorCase>& cases) {
  for (const ParseErrorCase& c : cases) {
    auto p = parse(c.text);
    ASSERT_FALSE(p.ok()) << c.text;
    EXPECT_EQ(p.status().code(), StatusCode::kInvalidArgument) << c.text;
    EXPECT_NE(p.status().message().find(c.needle), std::string::npos) << p.status().message();
  }
}

}  // namespace rc::transport::testing
