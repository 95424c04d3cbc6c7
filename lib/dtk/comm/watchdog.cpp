#include "dtk/comm/watchdog.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <mutex>
#include <thread>

#include <fmt/format.h>
#include <time.h>

namespace dtk::comm::watchdog {
namespace {
using Clock = std::chrono::steady_clock;

// One wait slot per thread that waits (the caller's thread, a communicator's thread copying a
// staged result to the GPU): a slot's start is 0 when no wait is in progress. Scopes nest within
// a thread; threads do not share a slot, so one thread's scope never ends another's.
struct Slot {
  std::atomic<long long> start_ns{0};
  std::atomic<const char*> what{nullptr};
  std::atomic<size_t> bytes{0};
};
constexpr int kSlots = 64;
Slot g_slots[kSlots];
std::atomic<int> g_used{0};  // slots handed out
thread_local Slot* t_slot = nullptr;

Slot& my_slot() {
  if (!t_slot) {
    const int i = g_used.fetch_add(1);
    t_slot = &g_slots[i < kSlots ? i : kSlots - 1];  // beyond 64 waiting threads, the last is shared
  }
  return *t_slot;
}

std::atomic<long long> g_timeout_ns{600'000'000'000LL};
std::atomic<long long> g_hurry_ns{0};  // when a stop was requested; 0: none
std::atomic<int> g_patient{0};         // Patient scopes alive
std::atomic<void (*)()> g_on_expire{nullptr};
int g_rank = 0;

std::mutex g_mu;
std::condition_variable g_cv;
bool g_stop = false;
std::thread g_thread;

long long now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}

// Runs the expiry hook (NCCL's aborts) for at most kExpireHookS: the job ends either way.
void run_expire_hook() {
  void (*hook)() = g_on_expire.load();
  if (!hook) return;
  auto done = std::make_shared<std::atomic<bool>>(false);
  std::thread([hook, done] {
    hook();
    done->store(true);
  }).detach();
  const auto until = Clock::now() + std::chrono::duration<double>(kExpireHookS);
  while (!done->load() && Clock::now() < until) std::this_thread::sleep_for(std::chrono::milliseconds(5));
}

[[noreturn]] void expire(const Slot& s, const char* reason) {
  const char* what = s.what.load();
  const size_t bytes = s.bytes.load();
  const std::string op = fmt::format("{}{}", what ? what : "a collective",
                                     bytes ? fmt::format(" of {} bytes", bytes) : std::string());
  std::fprintf(stderr, "dtk: error: rank %d: %s %s\n", g_rank, op.c_str(), reason);
  std::fflush(stderr);
  run_expire_hook();
  std::_Exit(1);
}

void loop() {
  std::unique_lock lock(g_mu);
  while (!g_stop) {
    const long long timeout = g_timeout_ns.load();
    const auto period = std::chrono::nanoseconds(std::clamp(timeout / 8, 10'000'000LL, 1'000'000'000LL));
    g_cv.wait_for(lock, period, [] { return g_stop; });
    if (g_stop) break;
    const long long now = now_ns(), hurry = g_hurry_ns.load();
    const int used = std::min(g_used.load(), kSlots);
    for (int i = 0; i < used; ++i) {
      const Slot& s = g_slots[i];
      const long long start = s.start_ns.load();
      if (start == 0) continue;
      if (hurry != 0 && g_patient.load() == 0 && now - std::max(start, hurry) > kHurryGraceS * 1e9)
        expire(s, fmt::format("has waited {:.0f} s since the stop was requested; a peer rank has probably died. "
                              "Ending the job.", kHurryGraceS).c_str());
      if (now - start > timeout)
        expire(s, fmt::format("did not complete within {:.1f} s; a peer rank has probably died or is stuck. Ending "
                              "the job (raise --comm-timeout if this step is legitimately that slow).",
                              static_cast<double>(timeout) / 1e9).c_str());
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

void on_expire(void (*hook)()) { g_on_expire.store(hook); }

Scope::Scope(const char* what, size_t bytes) : slot_(&my_slot()) {
  Slot& s = *static_cast<Slot*>(slot_);
  prev_start_ = s.start_ns.load(std::memory_order_relaxed);
  prev_what_ = s.what.load(std::memory_order_relaxed);
  prev_bytes_ = s.bytes.load(std::memory_order_relaxed);
  s.what.store(what, std::memory_order_relaxed);
  s.bytes.store(bytes, std::memory_order_relaxed);
  if (prev_start_ == 0) s.start_ns.store(now_ns(), std::memory_order_relaxed);
}

Scope::~Scope() {
  Slot& s = *static_cast<Slot*>(slot_);
  s.what.store(prev_what_, std::memory_order_relaxed);
  s.bytes.store(prev_bytes_, std::memory_order_relaxed);
  s.start_ns.store(prev_start_, std::memory_order_relaxed);
}

}  // namespace dtk::comm::watchdog
