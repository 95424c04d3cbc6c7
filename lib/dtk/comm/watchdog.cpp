#include "dtk/comm/watchdog.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <thread>

namespace dtk::comm::watchdog {
namespace {
using Clock = std::chrono::steady_clock;

std::atomic<long long> g_start_ns{0};  // 0: no wait in progress
std::atomic<const char*> g_what{nullptr};
std::atomic<size_t> g_bytes{0};
std::atomic<long long> g_timeout_ns{600'000'000'000LL};
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
    const long long start = g_start_ns.load();
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
