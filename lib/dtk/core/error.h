// Errors shared by every module. Two kinds, because programs map them to different exit codes:
// UsageError is bad usage or bad input (exit 2), Error is a failure while running (exit 1).
#pragma once
#include <fmt/format.h>

#include <stdexcept>
#include <string>
#include <utility>

namespace dtk {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class UsageError : public Error {
 public:
  using Error::Error;
};

// An error that every rank of the job raises together, after agreeing on it (an all-reduce of a
// success flag, say): the program then ends normally on every rank with the same exit code,
// instead of aborting the job as it must for an error that only one rank saw.
class AgreedError : public Error {
 public:
  AgreedError(const std::string& what, int exit_code) : Error(what), exit_code_(exit_code) {}
  int exit_code() const { return exit_code_; }

 private:
  int exit_code_;
};

[[noreturn]] void fail(const std::string& what);        // throws Error
[[noreturn]] void fail_usage(const std::string& what);  // throws UsageError

// The same with the message formatted by fmt, its format string checked at compile time:
// fail_usage("schedule: warmup must be >= 0, got {}", warmup). A single argument goes to the
// overloads above and is never read as a format string, so a message that is already built (and
// may hold braces) passes through as it is.
template <class... A>
  requires(sizeof...(A) > 0)
[[noreturn]] void fail(fmt::format_string<A...> format, A&&... args) {
  fail(fmt::format(format, std::forward<A>(args)...));
}
template <class... A>
  requires(sizeof...(A) > 0)
[[noreturn]] void fail_usage(fmt::format_string<A...> format, A&&... args) {
  fail_usage(fmt::format(format, std::forward<A>(args)...));
}

#define DTK_CHECK(cond, msg)                      \
  do {                                            \
    if (!(cond)) ::dtk::fail(std::string(msg));   \
  } while (0)

}  // namespace dtk
