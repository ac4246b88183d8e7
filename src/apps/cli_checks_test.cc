// cli_checks.h: FiniteNumber refuses what CLI::Range lets through (NaN, infinities), naming the
// value, keeps its bounds and checks every element of a vector option; HttpUrl wants a scheme.
#include "apps/cli_checks.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace rc::apps {
namespace {

// The parse error's message, or "" when the arguments parse.
std::string Parse(CLI::App& app, const std::vector<std::string>& args) {
  std::vector<const char*> argv{"prog"};
  for (const std::string& a : args) argv.push_back(a.c_str());
  try {
    app.parse(static_cast<int>(argv.size()), argv.data());
  } catch (const CLI::ParseError& e) {
    return e.what();
  }
  return "";
}

TEST(CliChecksTest, FiniteNumberRefusesNanAndInfinitiesAndKeepsItsBounds) {
  double x = -1;
  CLI::App app;
  app.add_option("--x", x)->check(FiniteNumber(0, 1));
  EXPECT_EQ(Parse(app, {"--x", "0.25"}), "");
  EXPECT_EQ(x, 0.25);
  EXPECT_EQ(Parse(app, {"--x", "1"}), "");
  for (const char* bad : {"nan", "NaN", "inf", "-inf", "1e400"}) {
    const std::string why = Parse(app, {"--x", bad});
    EXPECT_NE(why.find("is not a finite number"), std::string::npos) << bad << ": " << why;
    EXPECT_NE(why.find(bad), std::string::npos) << "names the value: " << why;
  }
  const std::string out = Parse(app, {"--x", "1.5"});
  EXPECT_NE(out.find("Value 1.5 is not in [0, 1]"), std::string::npos) << out;
  EXPECT_NE(Parse(app, {"--x", "-0.01"}), "");
  EXPECT_NE(Parse(app, {"--x", "half"}).find("is not a number"), std::string::npos);
}

TEST(CliChecksTest, UnboundedFiniteNumberTakesAnyFiniteValue) {
  double x = 0;
  CLI::App app;
  app.add_option("--x", x)->check(FiniteNumber());
  EXPECT_EQ(Parse(app, {"--x", "-1e300"}), "");
  EXPECT_EQ(x, -1e300);
  EXPECT_NE(Parse(app, {"--x", "nan"}), "");
}

TEST(CliChecksTest, AVectorOptionChecksEveryElement) {
  std::vector<double> xs;
  CLI::App app;
  app.add_option("--xs", xs)->check(FiniteNumber(0, 1));
  EXPECT_EQ(Parse(app, {"--xs", "0.01", "0.1"}), "");
  EXPECT_EQ(xs, (std::vector<double>{0.01, 0.1}));
  xs.clear();
  const std::string why = Parse(app, {"--xs", "0.01", "nan"});
  EXPECT_NE(why.find("nan"), std::string::npos) << why;
}

TEST(CliChecksTest, HttpUrlWantsASchemeAndAHost) {
  std::string url;
  CLI::App app;
  app.add_option("--url", url)->check(HttpUrl());
  EXPECT_EQ(Parse(app, {"--url", "http://127.0.0.1:7470"}), "");
  EXPECT_EQ(Parse(app, {"--url", "https://dir.example:443"}), "");
  EXPECT_EQ(Parse(app, {"--url", "http://127.0.0.1:7470/"}), "") << "a trailing slash is dropped where it is used";
  for (const char* bad : {"127.0.0.1:7470", "localhost", "http://", "ftp://x", "", "http://127.0.0.1:7470/v1"}) {
    const std::string why = Parse(app, {"--url", bad});
    EXPECT_NE(why.find("is not the base URL of a service"), std::string::npos) << bad << ": " << why;
  }
}

}  // namespace
}  // namespace rc::apps
