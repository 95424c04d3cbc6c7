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

// After a stop request (train/stop.h): from now on, a wait that lasts more than kHurryGraceS
// past the request ends the job as hung. A peer that died leaves the others waiting, and srun
// --kill-on-bad-exit asks them to stop with the same SIGTERM that a time limit sends; they
// would otherwise wait out the whole timeout. Async-signal-safe. unhurry() ends it. While a
// Patient lives (a checkpoint write: the other ranks wait for the writers), it does not apply.
inline constexpr double kHurryGraceS = 5;
void hurry();
void unhurry();
struct Patient {
  Patient();
  ~Patient();
  Patient(const Patient&) = delete;
  Patient& operator=(const Patient&) = delete;
};

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
