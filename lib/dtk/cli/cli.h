// What every dtk program shares: CLI11 set-up (--help, --version, --config FILE), logging on
// stderr (rank 0 unless --log-all-ranks), --comm-timeout, and exit codes that every rank agrees on.
//
// A program runs in two phases. validate() checks options and inputs without communicating; any
// rank's UsageError ends every rank with exit 2, cleanly. run() does the work; its return value
// is agreed (the maximum over ranks). An exception in run() on one rank cannot be agreed on (the
// others may be inside a collective), so with more than one rank it ends the job through
// MPI_Abort with the exception's exit code.
#pragma once
#include <CLI/CLI.hpp>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

#include "dtk/comm/comm.h"

namespace dtk::cli {

inline constexpr int kExitOk = 0;
inline constexpr int kExitFailure = 1;
inline constexpr int kExitUsage = 2;

struct Program {
  std::string name;
  std::string description;
  std::string footer;  // shown after the options in --help (examples, exit codes)
  std::function<void(CLI::App&)> add_options;
  std::function<void(comm::Runtime&)> validate;  // optional
  std::function<int(comm::Runtime&)> run;
};

// The whole main() of a program: `int main(int c, char** v) { return dtk::cli::main(c, v, program()); }`
int main(int argc, char** argv, const Program& program);

std::string version_string(const std::string& program);

// Sizes with binary suffixes: 8, 64K, 64KiB, 1M, 2G (K = 1024). UsageError on anything else.
uint64_t parse_size(std::string_view s);
std::string format_size(uint64_t bytes);  // 64K, 1M, 3.5M, 17

}  // namespace dtk::cli
