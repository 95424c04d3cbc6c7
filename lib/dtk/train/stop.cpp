#include "dtk/train/stop.h"

#include "dtk/comm/watchdog.h"

#include <signal.h>
#include <time.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <iterator>

namespace dtk::train {
namespace {

constexpr int kSignals[] = {SIGTERM, SIGINT, SIGUSR1};
// Signals within this long of the first are the same request: SLURM's time limit reaches each
// task twice, from its slurmstepd and again through srun, 70-150 ms apart (measured).
constexpr int64_t kSameRequestNs = 2'000'000'000;
std::atomic<int> g_received{0};
std::atomic<int64_t> g_first_ns{0};
struct sigaction g_previous[std::size(kSignals)];

int64_t now_ns() {  // clock_gettime is async-signal-safe
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return static_cast<int64_t>(t.tv_sec) * 1'000'000'000 + t.tv_nsec;
}

extern "C" void on_stop_signal(int sig) {
  int none = 0;
  if (g_received.compare_exchange_strong(none, sig)) {
    g_first_ns = now_ns();
    comm::watchdog::hurry();  // a wait that outlasts the request by seconds: a peer died
    return;
  }
  if (now_ns() - g_first_ns.load() < kSameRequestNs) return;
  // A second request: the default action, now (signal() and raise() are async-signal-safe).
  ::signal(sig, SIG_DFL);
  ::raise(sig);
}

}  // namespace

StopSignals::StopSignals() {
  static_assert(std::atomic<int>::is_always_lock_free && std::atomic<int64_t>::is_always_lock_free);
  g_received = 0;
  struct sigaction sa;
  std::memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_stop_signal;
  sa.sa_flags = SA_RESTART;  // system calls in progress (file writes, MPI) carry on
  sigemptyset(&sa.sa_mask);
  for (size_t i = 0; i < std::size(kSignals); ++i) sigaction(kSignals[i], &sa, &g_previous[i]);
}

StopSignals::~StopSignals() {
  comm::watchdog::unhurry();
  for (size_t i = 0; i < std::size(kSignals); ++i) sigaction(kSignals[i], &g_previous[i], nullptr);
}

int StopSignals::received() const { return g_received.load(); }

const char* signal_name(int sig) {
  switch (sig) {
    case SIGTERM: return "SIGTERM";
    case SIGINT: return "SIGINT";
    case SIGUSR1: return "SIGUSR1";
    default: return "a signal";
  }
}

}  // namespace dtk::train
