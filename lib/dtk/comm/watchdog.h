// The collective watchdog: one thread per process that ends the job when a wait on a collective
// lasts longer than the timeout, instead of letting the job hang (a peer died inside MPI, or is
// stuck). Waiting code marks itself with a Scope; the cost is one clock read and two stores, so
// it wraps even the 8-byte all-reduce.
#pragma once
#include <cstddef>

namespace dtk::comm::watchdog {

void start(double timeout_s, int rank);
void set_timeout(double timeout_s);
void stop();

class Scope {
 public:
  Scope(const char* what, size_t bytes);
  ~Scope();
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

 private:
  long long prev_start_;
  const char* prev_what_;
  size_t prev_bytes_;
};

}  // namespace dtk::comm::watchdog
