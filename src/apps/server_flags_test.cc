// Issue 36, defect 9: the server key can come from a file (--api-key-file), so it need not sit on
// a command line every local user can read; --api-key still works but warns and says so in --help.
#include "apps/server_flags.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "rolloutcore/base/log.h"

namespace rc::apps {
namespace {

namespace fs = std::filesystem;

class ServerFlagsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("rc_server_flags_" + std::to_string(::getpid()));
    fs::create_directories(dir_);
    ::unsetenv(net::kApiKeyEnv);
  }
  void TearDown() override {
    fs::remove_all(dir_);
    ::unsetenv(net::kApiKeyEnv);
    net::SetDefaultClientConfig(net::ClientConfig{});
  }
  std::string Write(const std::string& name, const std::string& text) {
    std::string p = (dir_ / name).string();
    std::ofstream(p, std::ios::binary) << text;
    return p;
  }
  // Parses `args` as a serve command's flags, then resolves them.
  Status Run(const std::string& args, net::ServerSecurity* sec) {
    CLI::App app;
    AddServerSecurityFlags(&app, sec);
    try {
      app.parse(args, /*program_name_included=*/false);
    } catch (const CLI::ParseError& e) {
      return InvalidArgument(std::string("parse: ") + e.what());
    }
    return ResolveServerSecurity(sec);
  }

  fs::path dir_;
};

TEST_F(ServerFlagsTest, KeyFileIsReadWithoutItsLineEnding) {
  for (const char* text : {"s3cret\n", "s3cret", "s3cret\r\n"}) {
    net::ServerSecurity sec;
    Status s = Run("--api-key-file " + Write("key", text), &sec);
    ASSERT_TRUE(s.ok()) << s.ToString();
    EXPECT_EQ(sec.api_key, "s3cret");
    EXPECT_EQ(net::ClientConfig::Default().api_key, "s3cret") << "the server's key is its clients' key too";
  }
  ::setenv(net::kApiKeyEnv, "from-env", 1);  // the file wins over the environment
  net::ServerSecurity sec;
  ASSERT_TRUE(Run("--api-key-file " + Write("key", "from-file\n"), &sec).ok());
  EXPECT_EQ(sec.api_key, "from-file");
}

TEST_F(ServerFlagsTest, BadKeyFilesAreRefusedNamingThePath) {
  const std::string missing = (dir_ / "missing").string();
  const std::pair<std::string, std::string> cases[] = {
      {Write("empty", ""), "the file is empty"},
      {Write("newline", "\n"), "the file is empty"},
      {Write("two", "a\nb\n"), "more than one line"},
      {Write("huge", std::string(70000, 'k')), "over 65536 bytes"},
      {missing, "cannot read it"},
      {dir_.string(), "not a regular file"},
  };
  for (const auto& [path, why] : cases) {
    net::ServerSecurity sec;
    Status s = Run("--api-key-file " + path, &sec);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << path;
    EXPECT_NE(s.message().find("--api-key-file '" + path + "'"), std::string::npos) << s.message();
    EXPECT_NE(s.message().find(why), std::string::npos) << s.message();
    EXPECT_TRUE(sec.api_key.empty());
  }
}

TEST_F(ServerFlagsTest, KeyAndKeyFileTogetherAreRefused) {
  net::ServerSecurity sec;
  Status s = Run("--api-key k --api-key-file " + Write("key", "k2\n"), &sec);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("--api-key and --api-key-file"), std::string::npos) << s.message();
}

TEST_F(ServerFlagsTest, KeyOnTheCommandLineWorksButWarns) {
  CLI::App app;
  net::ServerSecurity sec;
  AddServerSecurityFlags(&app, &sec);
  const std::string help = app.help();
  EXPECT_NE(help.find("--api-key-file"), std::string::npos) << help;
  EXPECT_NE(app.get_option("--api-key")->get_description().find("Visible to every local user in ps"),
            std::string::npos);
  InitLoggingFromEnv();  // the process's logger writes to stderr
  app.parse("--api-key k1", false);
  ::testing::internal::CaptureStderr();
  Status s = ResolveServerSecurity(&sec);
  const std::string err = ::testing::internal::GetCapturedStderr();
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(sec.api_key, "k1");
  EXPECT_NE(err.find("every local user can read it (ps"), std::string::npos) << err;

  ::setenv(net::kApiKeyEnv, "env-key", 1);  // no flag: the environment, without a warning
  net::ServerSecurity from_env;
  ::testing::internal::CaptureStderr();
  ASSERT_TRUE(Run("", &from_env).ok());
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
  EXPECT_EQ(from_env.api_key, "env-key");
}

}  // namespace
}  // namespace rc::apps
