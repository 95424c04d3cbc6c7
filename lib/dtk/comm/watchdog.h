// The collective watchdog: one thread per process that ends the job when a wait on a collective
// lasts longer than the timeout, instead of letting the job hang (a peer died inside MPI, or is
// stuck). Waiting code marks itself with a Scope, per thread (a communicator's own thread may
// wait beside the caller's); the cost is one clock read and a few stores, so it wraps even the
// 8-byte all-reduce. The host's waits for the GPU are under it too (comm::Runtime installs
// cuda::set_wait_hook). When it ends the job it runs the expiry hook first (on_expire: NCCL
// aborts its communicators there, so that peers see the end instead of waiting in a kernel).
//
// Naming the culprit: when a wait outlasts the timeout on a job of several ranks, the rank whose
// watchdog fires first gathers the flight records (flight.h) of every rank over the side channel
// (side_channel.h), where each rank's answer comes from a thread of its own, and the lowest rank
// that answered prints one line naming the rank(s) that never reached the collective and where
// they are (flight::diagnose); the others end quietly, all with exit status 1 (a rank that
// was stopped and runs again, as a launcher's SIGCONT before its kill lets it, ends quietly
// too). Without a side channel (one rank, or no socket) each rank says what it waited for.
#pragma once
#include <cstddef>
#include <string>

namespace dtk::comm::watchdog {

void start(double timeout_s, int rank, int size);
// Opens this process's side channel, whose server answers the other ranks' requests; returns
// its port, or -1 without one. Called by comm::Runtime before the ports are exchanged.
int open_side_channel();
// Where every rank writes its flight records (flight-rank-NNNNN.json): when the watchdog ends
// the job (each rank that still runs, the stopped ones excepted) and when the process ends
// normally. Empty: nowhere.
void set_debug_dir(const std::string& dir);
// Called by the watchdog thread before it ends the job, for at most kExpireHookS seconds.
inline constexpr double kExpireHookS = 3;
void on_expire(void (*hook)());
// True once this process's watchdog has decided to end the job (it then runs the expiry hook
// and exits within kExpireHookS). A thread that the expiry hook releases (NCCL's abort ends the
// kernels it waited for) must not carry on with results that never arrived: park() blocks it
// until the exit.
bool ending();
[[noreturn]] void park();
void set_timeout(double timeout_s);
// Stops the watchdog's thread and writes the flight records; the side channel stays open (comm::Runtime
// closes it after MPI_Finalize: side::leave_together needs it).
void stop();

// After a stop request (train/stop.h): from now on, a wait that lasts more than kHurryGraceS
// past the request ends the job as hung. A peer that died leaves the others waiting, and srun
// --kill-on-bad-exit asks them to stop with the same SIGTERM that a time limit sends; they
// would otherwise wait out the whole timeout. Sooner than that, a wait that lasts kDeadProbeS
// past the request makes the watchdog ask the side channel which peers are still there, every
// kDeadProbeEveryS: a peer whose process is gone refuses the connection at once, and the job
// ends then (a healthy job's peers are all there, so its graceful stop is unchanged; a stopped
// or hung peer is still there, and kHurryGraceS applies). Async-signal-safe. unhurry() ends it.
// While a Patient lives (a checkpoint write: the other ranks wait for the writers), the grace
// does not apply; the probe for peers that are gone still does.
inline constexpr double kHurryGraceS = 5;
inline constexpr double kDeadProbeS = 0.5;
inline constexpr double kDeadProbeEveryS = 0.25;
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
  void* slot_;  // this thread's
  long long prev_start_;
  const char* prev_what_;
  size_t prev_bytes_;
};

}  // namespace dtk::comm::watchdog
