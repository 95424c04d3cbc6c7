#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <map>
#include <sstream>

#include "dtk/cli/cli.h"
#include "dtk/cli/parse.h"
#include "dtk/core/error.h"

namespace dtk::cli {
namespace {

TEST(Cli, ParseSize) {
  EXPECT_EQ(parse_size("0"), 0u);
  EXPECT_EQ(parse_size("8"), 8u);
  EXPECT_EQ(parse_size("8B"), 8u);
  EXPECT_EQ(parse_size("64K"), 65536u);
  EXPECT_EQ(parse_size("64k"), 65536u);
  EXPECT_EQ(parse_size("64KiB"), 65536u);
  EXPECT_EQ(parse_size("64KB"), 65536u);
  EXPECT_EQ(parse_size("1M"), 1u << 20);
  EXPECT_EQ(parse_size("1.5M"), 3u << 19);
  EXPECT_EQ(parse_size("2G"), 2ull << 30);
  for (const char* bad : {"", "x", "-1", "1X", "1KX", "1.5", "0.3K", "K"}) EXPECT_THROW(parse_size(bad), UsageError) << bad;
}

TEST(Cli, FormatSize) {
  EXPECT_EQ(format_size(17), "17");
  EXPECT_EQ(format_size(65536), "64K");
  EXPECT_EQ(format_size(3u << 19), "1.5M");
  EXPECT_EQ(format_size(1ull << 30), "1G");
}

TEST(Cli, TomlConfigItems) {
  CLI::App app;
  TomlConfig c(&app);
  std::istringstream in("# a job\nlr = 3e-4\nsteps = 300\nnesterov = true\nmodel = \"llama-tiny\"\n"
                        "decay-steps = [100, 200]\n");
  std::map<std::string, std::vector<std::string>> items;  // toml++ orders a table's keys
  for (const auto& i : c.from_config(in)) items[i.name] = i.inputs;
  ASSERT_EQ(items.size(), 5u);
  EXPECT_EQ(items["lr"], std::vector<std::string>{"0.0003"});
  EXPECT_EQ(items["steps"], std::vector<std::string>{"300"});
  EXPECT_EQ(items["nesterov"], std::vector<std::string>{"true"});
  EXPECT_EQ(items["model"], std::vector<std::string>{"llama-tiny"});
  EXPECT_EQ(items["decay-steps"], (std::vector<std::string>{"100", "200"}));
  EXPECT_EQ(c.where("steps"), "line 3: steps = 300");
  EXPECT_EQ(c.where("model"), "line 5: model = 'llama-tiny'");
  EXPECT_EQ(c.where("seed"), "");
}

TEST(Cli, TomlConfigRefusesWhatIsNotTomlOrNoOption) {
  CLI::App app;
  TomlConfig c(&app);
  auto error = [&](const std::string& text) {
    std::istringstream in(text);
    try {
      c.from_config(in);
    } catch (const CLI::ConfigError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(error("steps = [1,\n").rfind("line 1, column 13: not TOML", 0), 0u) << error("steps = [1,\n");
  EXPECT_NE(error("model = llama-tiny\n").find("text needs quotes"), std::string::npos);
  EXPECT_EQ(error("steps = 1979-05-27\n"), "line 1, column 9: steps is a date, which no option takes");
  EXPECT_EQ(error("[train]\nsteps = 3\n"), "line 1: [train]: no subcommand train (a section holds a subcommand's options)");
}

TEST(Cli, ClosestOption) {
  CLI::App app;
  int v = 0;
  for (const char* n : {"--steps", "--stop-at", "--seed", "--lr", "--warmup", "--checkpoint-dir"}) app.add_option(n, v);
  EXPECT_EQ(closest_option(app, "step"), "steps");
  EXPECT_EQ(closest_option(app, "setps"), "steps");
  EXPECT_EQ(closest_option(app, "warmpu"), "warmup");
  EXPECT_EQ(closest_option(app, "checkpoint"), "checkpoint-dir");  // the only option it begins
  EXPECT_EQ(closest_option(app, "frobnicate"), "");
}

TEST(Cli, ParseErrorLines) {
  CLI::App app;
  int steps = 1;
  app.add_option("--steps", steps)->check(at_least(1));
  app.add_subcommand("ls");
  app.add_subcommand("show");
  auto line = [&](std::vector<std::string> args) {
    std::vector<std::string> argv = args;
    std::reverse(argv.begin(), argv.end());
    try {
      app.parse(argv);
    } catch (const CLI::ParseError& e) {
      return parse_error_line(app, e, args, nullptr).first;
    }
    return std::string("parsed");
  };
  EXPECT_EQ(line({"--step", "5"}), "unknown option --step; did you mean --steps?");
  EXPECT_EQ(line({"--steps", "0", "ls"}), "--steps must be at least 1");
  EXPECT_EQ(line({"--steps", "1.5", "ls"}), "--steps must be a whole number, not 1.5");
}

// DTK_LAUNCH_MARK (share/dtk/slurm/*.sbatch): rank 0 creates the file, once; other ranks and an
// unset variable create nothing.
TEST(Cli, MarkLaunched) {
  const std::filesystem::path mark = std::filesystem::temp_directory_path() / ("dtk-mark-" + std::to_string(::getpid()));
  std::filesystem::remove(mark);
  ::unsetenv("DTK_LAUNCH_MARK");
  mark_launched(0);  // no variable: nothing, and a later call with one still works
  ::setenv("DTK_LAUNCH_MARK", mark.c_str(), 1);
  mark_launched(1);
  EXPECT_FALSE(std::filesystem::exists(mark)) << "rank 1 created the mark";
  mark_launched(0);
  EXPECT_TRUE(std::filesystem::exists(mark));
  std::filesystem::remove(mark);
  mark_launched(0);
  EXPECT_FALSE(std::filesystem::exists(mark)) << "a second call created the mark again";
  ::unsetenv("DTK_LAUNCH_MARK");
}

}  // namespace
}  // namespace dtk::cli
