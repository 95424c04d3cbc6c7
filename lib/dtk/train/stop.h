// dtk::train — graceful stop on a signal.
//
// While a StopSignals lives, the first SIGTERM, SIGINT or SIGUSR1 only records itself: the
// training loop learns of it at its next step (every rank, through the step's loss all-reduce),
// finishes that step, writes a checkpoint and ends with kExitStopped on every rank. A second
// signal, of any of the three, ends the process at once, as the signal's default action would,
// when it comes 2 s or more after the first (earlier ones are the same request delivered twice,
// as SLURM does at a time limit).
// SLURM sends SIGTERM at a job's time limit (and on scancel), and a chosen signal earlier with
// --signal; mpiexec forwards SIGUSR1 to the ranks.
#pragma once

namespace dtk::train {

class StopSignals {
 public:
  StopSignals();   // installs the handlers
  ~StopSignals();  // restores the previous ones
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

  // The first signal's number, 0 while none came.
  int received() const;
};

// "SIGTERM", "SIGINT", "SIGUSR1" (or "signal N").
const char* signal_name(int sig);

}  // namespace dtk::train
