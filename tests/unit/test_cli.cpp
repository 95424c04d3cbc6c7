#include <gtest/gtest.h>

#include "dtk/cli/cli.h"
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

}  // namespace
}  // namespace dtk::cli
