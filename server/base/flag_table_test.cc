#include "server/base/flag_table.h"

#include <unistd.h>

#include <cstdio>
#include <map>
#include <string>

#include <gtest/gtest.h>

#include "absl/strings/match.h"

namespace weightd {
namespace {

struct Opts {
  std::string socket;
  std::vector<std::string> roots;
  uint64_t threads = 0;
  bool insecure = false;
};

FlagTable Table(Opts* o) {
  FlagTable t("prog", "PROG");
  t.Add({"socket", "PATH", "the socket", FlagSpec::Kind::kValue, StringInto(&o->socket)})
      .Add({"model-root", "DIR", "roots", FlagSpec::Kind::kList, AppendInto(&o->roots)})
      .Add({"threads", "N", "workers", FlagSpec::Kind::kValue, Uint64Into("threads", &o->threads, 1, 8)})
      .Add({"allow-insecure", "", "a switch", FlagSpec::Kind::kSwitch,
            [o](const std::string& v) {
              o->insecure = v == "true";
              return absl::OkStatus();
            }});
  return t;
}

struct Env {
  std::map<std::string, std::string> vars;
  std::function<const char*(const char*)> fn() {
    return [this](const char* name) -> const char* {
      auto it = vars.find(name);
      return it == vars.end() ? nullptr : it->second.c_str();
    };
  }
};

std::string TempConfig(const std::string& text) {
  char path[] = "/tmp/flag_table_test_XXXXXX";
  int fd = mkstemp(path);
  EXPECT_GE(fd, 0);
  EXPECT_EQ(write(fd, text.data(), text.size()), static_cast<ssize_t>(text.size()));
  close(fd);
  return path;
}

TEST(FlagTableTest, CommandLineValuesInlineValuesListsAndSwitches) {
  Opts o;
  Env env;
  auto r = Table(&o).Parse({"--socket", "/s", "--model-root", "/a", "/b", "--model-root=/c",
                            "--threads=4", "--allow-insecure"},
                           env.fn());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(o.socket, "/s");
  EXPECT_EQ(o.roots, (std::vector<std::string>{"/a", "/b", "/c"}));
  EXPECT_EQ(o.threads, 4u);
  EXPECT_TRUE(o.insecure);
  Opts p;
  ASSERT_TRUE(Table(&p).Parse({"--allow-insecure=no"}, env.fn()).ok());
  EXPECT_FALSE(p.insecure);
}

TEST(FlagTableTest, ErrorsNameTheFlag) {
  Opts o;
  Env env;
  auto unknown = Table(&o).Parse({"--bogus", "1"}, env.fn());
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StartsWith(unknown.status().message(), "unknown flag \"--bogus\""));
  auto missing = Table(&o).Parse({"--socket"}, env.fn());
  EXPECT_EQ(missing.status().message(), "--socket needs a value");
  auto nan = Table(&o).Parse({"--threads", "lots"}, env.fn());
  EXPECT_EQ(nan.status().message(), "--threads: \"lots\" is not a number");
  auto range = Table(&o).Parse({"--threads", "9"}, env.fn());
  EXPECT_EQ(range.status().message(), "--threads must be 1..8");
  auto sw = Table(&o).Parse({"--allow-insecure=maybe"}, env.fn());
  EXPECT_EQ(sw.status().code(), absl::StatusCode::kInvalidArgument);
  auto stray = Table(&o).Parse({"word"}, env.fn());
  EXPECT_EQ(stray.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(FlagTableTest, EnvironmentNamesComeFromTheTable) {
  Opts o;
  FlagTable t = Table(&o);
  EXPECT_EQ(t.EnvName("model-root"), "PROG_MODEL_ROOT");
  Env env;
  env.vars = {{"PROG_MODEL_ROOT", "/x,/y"}, {"PROG_THREADS", "2"}, {"PROG_ALLOW_INSECURE", "1"},
              {"PROG_UNRELATED", "z"}};
  ASSERT_TRUE(t.Parse({}, env.fn()).ok());
  EXPECT_EQ(o.roots, (std::vector<std::string>{"/x", "/y"}));
  EXPECT_EQ(o.threads, 2u);
  EXPECT_TRUE(o.insecure);
}

TEST(FlagTableTest, CommandLineBeatsEnvironmentBeatsConfigFile) {
  std::string conf = TempConfig(
      "# comment\nsocket = /file\nmodel-root = /f1\n--model-root = /f2\nthreads = 3\n");
  Opts o;
  Env env;
  env.vars = {{"PROG_SOCKET", "/env"}};
  auto r = Table(&o).Parse({"--config", conf, "--threads", "5"}, env.fn());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(o.socket, "/env");
  EXPECT_EQ(o.roots, (std::vector<std::string>{"/f1", "/f2"}));  // the file's whole list
  EXPECT_EQ(o.threads, 5u);
  // The effective arguments, file < env < argv.
  EXPECT_EQ(*r, (std::vector<std::string>{"--model-root", "/f1", "--model-root", "/f2",
                                          "--socket", "/env", "--threads", "5"}));
  // PROG_CONFIG names the file too; a stronger source replaces a list whole.
  Opts p;
  env.vars = {{"PROG_CONFIG", conf}, {"PROG_MODEL_ROOT", "/e"}};
  ASSERT_TRUE(Table(&p).Parse({}, env.fn()).ok());
  EXPECT_EQ(p.roots, (std::vector<std::string>{"/e"}));
  EXPECT_EQ(p.socket, "/file");
  std::remove(conf.c_str());
}

TEST(FlagTableTest, BadConfigFiles) {
  Opts o;
  Env env;
  std::string unknown = TempConfig("colour = blue\n");
  auto r = Table(&o).Parse({"--config", unknown}, env.fn());
  EXPECT_EQ(r.status().message(), "config " + unknown + ": unknown flag \"colour\"");
  std::string malformed = TempConfig("socket /x\n");
  r = Table(&o).Parse({"--config=" + malformed}, env.fn());
  EXPECT_EQ(r.status().message(), malformed + ":1: expected flag = value");
  r = Table(&o).Parse({"--config", "/nonexistent/weightd.conf"}, env.fn());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound);
  std::remove(unknown.c_str());
  std::remove(malformed.c_str());
}

TEST(FlagTableTest, UsageListsEveryFlagOnce) {
  Opts o;
  FlagTable t = Table(&o);
  std::string u = t.Usage();
  for (const char* line : {"--socket PATH", "--model-root DIR ...", "--threads N",
                           "--allow-insecure ", "--config FILE", "PROG_<FLAG>"}) {
    EXPECT_NE(u.find(line), std::string::npos) << line << "\n" << u;
  }
  EXPECT_TRUE(FlagTable::WantsHelp({"--socket", "x", "-h"}));
  EXPECT_FALSE(FlagTable::WantsHelp({"--socket", "--help-me"}));
}

}  // namespace
}  // namespace weightd
