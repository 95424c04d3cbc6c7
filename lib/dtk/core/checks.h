// The checks that every program's options share, in one place.
//
// Numeric rules are CLI11 validators (->check(cli::at_least(1))). CLI11 reports a failed check as
// CLI::ValidationError "NAME: MESSAGE"; these rules' messages start with "must", and cli::main
// joins the two into one sentence that names the option and states the rule:
//   psgd-train: error: --steps must be at least 1
// A value that is not a finite number fails every rule ("--lr must be a finite number").
//
// Output paths are checked before any work starts, on every rank, creating nothing (UsageError
// naming the option and the problem: exit 2).
//
// In core (namespace dtk::cli, the programs' command line): the options that dtk::train
// registers use these rules, and train sits below the cli module. It needs CLI11 and core only.
#pragma once
#include <CLI/CLI.hpp>
#include <string>

namespace dtk::cli {

CLI::Validator at_least(double min);            // "must be at least MIN"
CLI::Validator at_most(double max);             // "must be at most MAX"
CLI::Validator positive();                      // "must be positive" (> 0)
CLI::Validator between(double lo, double hi);   // "must be between LO and HI" (both included)

// A directory that the run creates if it is missing (--checkpoint-dir): the path must be a
// directory, or its nearest existing ancestor must be a directory that this process may write
// (so that a path through a regular file, or under a read-only directory, is refused).
void check_output_dir(const std::string& option, const std::string& path);
// The directory that a file or directory `path` is written into (as a temporary name, then
// renamed) exists and this process may write it.
void check_output_parent(const std::string& option, const std::string& path);
// A file that the run writes or appends to (--save, --metrics): not a directory;
// check_output_parent; the file itself, if it exists, is writable.
void check_output_file(const std::string& option, const std::string& path);

}  // namespace dtk::cli
