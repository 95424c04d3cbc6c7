#include "dtk/comm/watchdog.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <thread>

#include <time.h>

namespace dtk::comm::watchdog {
namespace {
using Clock = std::chrono::steady_clock;

std::atomic<long long> g_start_ns{0};  // 0: no wait in progress
std::atomic<const char*> g_what{nullptr};
std::atomic<size_t> g_bytes{0};
std::atomic<long long> g_timeout_ns{600'000'000'000LL};
std::atomic<long long> g_hurry_ns{0};  // when a stop was requested; 0: none
std::atomic<int> g_patient{0};         // Patient scopes alive
int g_rank = 0;

std::mutex g_mu;
std::condition_variable g_cv;
bool g_stop = false;
std::thread g_thread;

long long now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}

void loop() {
  std::unique_lock lock(g_mu);
  while (!g_stop) {
    const long long timeout = g_timeout_ns.load();
    const auto period = std::chrono::nanoseconds(std::clamp(timeout / 8, 10'000'000LL, 1'000'000'000LL));
    g_cv.wait_for(lock, period, [] { return g_stop; });
    if (g_stop) break;
    const long long start = g_start_ns.load(), hurry = g_hurry_ns.load();
    if (start != 0 && hurry != 0 && g_patient.load() == 0 && now_ns() - std::max(start, hurry) > kHurryGraceS * 1e9) {
      const char* what = g_what.load();
      std::fprintf(stderr,
                   "dtk: error: rank %d: %s of %zu bytes has waited %.0f s since the stop was requested; a peer "
                   "rank has probably died. Ending the job.\n",
                   g_rank, what ? what : "a collective", g_bytes.load(), kHurryGraceS);
      std::fflush(stderr);
      std::_Exit(1);
    }
    if (start != 0 && now_ns() - start > timeout) {
      const char* what = g_what.load();
      std::fprintf(stderr,
                   "dtk: error: rank %d: %s of %zu bytes did not complete within %.1f s; a peer rank has "
                   "probably died or is stuck. Ending the job (raise --comm-timeout if this step is "
                   "legitimately that slow).\n",
                   g_rank, what ? what : "a collective", g_bytes.load(), static_cast<double>(timeout) / 1e9);
      std::fflush(stderr);
      std::_Exit(1);
    }
  }
}
}  // namespace

void start(double timeout_s, int rank) {
  g_rank = rank;
  set_timeout(timeout_s);
  std::lock_guard lock(g_mu);
  if (g_thread.joinable()) return;
  g_stop = false;
  g_thread = std::thread(loop);
}

void set_timeout(double timeout_s) { g_timeout_ns.store(static_cast<long long>(timeout_s * 1e9)); }

void hurry() {
  timespec t;  // CLOCK_MONOTONIC: steady_clock's on Linux; clock_gettime is async-signal-safe
  clock_gettime(CLOCK_MONOTONIC, &t);
  g_hurry_ns.store(static_cast<long long>(t.tv_sec) * 1'000'000'000LL + t.tv_nsec);
}

void unhurry() { g_hurry_ns.store(0); }
Patient::Patient() { ++g_patient; }
Patient::~Patient() { --g_patient; }

void stop() {
  {
    std::lock_guard lock(g_mu);
    g_stop = true;
  }
  g_cv.notify_all();
  if (g_thread.joinable()) g_thread.join();
}

Scope::Scope(const char* what, size_t bytes)
    : prev_start_(g_start_ns.load(std::memory_order_relaxed)),
      prev_what_(g_what.load(std::memory_order_relaxed)),
      prev_bytes_(g_bytes.load(std::memory_order_relaxed)) {
  g_what.store(what, std::memory_order_relaxed);
  g_bytes.store(bytes, std::memory_order_relaxed);
  if (prev_start_ == 0) g_start_ns.store(now_ns(), std::memory_order_relaxed);
}

Scope::~Scope() {
  g_what.store(prev_what_, std::memory_order_relaxed);
  g_bytes.store(prev_bytes_, std::memory_order_relaxed);
  g_start_ns.store(prev_start_, std::memory_order_relaxed);
}

}  // namespace dtk::comm::watchdog
