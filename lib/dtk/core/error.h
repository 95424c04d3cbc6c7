// Errors shared by every module. Two kinds, because programs map them to different exit codes:
// UsageError is bad usage or bad input (exit 2), Error is a failure while running (exit 1).
#pragma once
#include <stdexcept>
#include <string>

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

#define DTK_CHECK(cond, msg)                      \
  do {                                            \
    if (!(cond)) ::dtk::fail(std::string(msg));   \
  } while (0)

}  // namespace dtk
