#include "dtk/comm/watchdog.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <time.h>
#include <unistd.h>

#include "dtk/comm/flight.h"
#include "dtk/comm/side_channel.h"

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
std::atomic<bool> g_ending{false};  // the job is being ended (ending())
int g_rank = 0, g_size = 1;

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

// ---- the flight records and the side channel ----
constexpr double kAskS = 0.5;      // how long the other ranks have to answer
constexpr double kReportS = 3.0;   // how long a rank that was asked waits for the report before it ends
constexpr double kProbeS = 0.2;    // how long a peer has to accept a connection when probed
std::mutex g_dir_mu;
std::string g_debug_dir;
constexpr double kStoppedGapS = 2.0;  // the watchdog thread did not run this long: the process was stopped
std::atomic<bool> g_queried{false};  // another rank gathered the records: it reports
std::atomic<bool> g_printed{false};  // this process printed the report
bool g_was_stopped = false;          // the watchdog thread's: its ticks had a gap of kStoppedGapS

std::vector<flight::Wait> current_waits() {
  std::vector<flight::Wait> out;
  const long long now = now_ns();
  const int used = std::min(g_used.load(), kSlots);
  for (int i = 0; i < used; ++i) {
    const long long start = g_slots[i].start_ns.load();
    const char* what = g_slots[i].what.load();
    if (start) out.push_back({what ? what : "a collective", g_slots[i].bytes.load(), (now - start) / 1e9});
  }
  return out;
}

// This rank's records into the debug directory, replacing the file whole (a temporary renamed).
void write_records() {
  std::string dir;
  {
    std::lock_guard lock(g_dir_mu);
    dir = g_debug_dir;
  }
  if (dir.empty()) return;
  const std::string path = fmt::format("{}/flight-rank-{:05d}.json", dir, g_rank);
  const std::string tmp = fmt::format("{}.tmp.{}", path, static_cast<long>(getpid()));
  const std::string text = flight::to_json(flight::snapshot(g_rank, current_waits()));
  if (FILE* f = std::fopen(tmp.c_str(), "w")) {
    const bool ok = std::fwrite(text.data(), 1, text.size(), f) == text.size();
    if (std::fclose(f) == 0 && ok && std::rename(tmp.c_str(), path.c_str()) == 0) return;
    std::remove(tmp.c_str());
  }
  std::fprintf(stderr, "dtk: warning: rank %d: cannot write %s\n", g_rank, path.c_str());
}

void print_once(const std::string& line) {
  if (g_printed.exchange(true)) return;
  std::fprintf(stderr, "dtk: error: %s\n", line.c_str());
  std::fflush(stderr);
}

// The side channel's requests: 'Q' (the records; another rank reports), 'P' (print this line).
std::string handle(char kind, const std::string& body) {
  if (kind == 'Q') {
    g_queried = true;
    write_records();
    return flight::serialize(flight::snapshot(g_rank, current_waits()));
  }
  if (kind == 'P') {
    print_once(body);
    return "k";
  }
  return "";
}

std::vector<int> other_ranks() {
  std::vector<int> out;
  for (int r = 0; r < g_size; ++r)
    if (r != g_rank) out.push_back(r);
  return out;
}

[[noreturn]] void end_job() {
  g_ending = true;
  run_expire_hook();
  std::_Exit(1);
}

// The rank's own line for a wait that cannot end.
[[noreturn]] void expire(const Slot& s, const char* reason) {
  const char* what = s.what.load();
  const size_t bytes = s.bytes.load();
  print_once(fmt::format("rank {}: {}{} {}", g_rank, what ? what : "a collective",
                         bytes ? fmt::format(" of {} bytes", bytes) : std::string(), reason));
  write_records();
  end_job();
}

// A wait outlasted the timeout (see the header comment).
[[noreturn]] void expire_timeout(const Slot& s, double timeout_s) {
  const char* what = s.what.load();
  const size_t bytes = s.bytes.load();
  const std::string mine =
      fmt::format("rank {}: {}{} did not complete within {:.1f} s; a peer rank has probably died or is stuck. Ending "
                  "the job (raise --comm-timeout if this step is legitimately that slow).",
                  g_rank, what ? what : "a collective", bytes ? fmt::format(" of {} bytes", bytes) : std::string(),
                  timeout_s);
  if (!side::ready()) {
    print_once(mine);
    end_job();
  }
  // The process was stopped (SIGSTOP) and runs again, as a launcher ending the job lets it: it
  // is the culprit, and the others have reported; or another rank gathers the records and
  // reports: leave it the time to.
  if (g_queried || g_was_stopped) {
    write_records();
    const auto until = Clock::now() + std::chrono::duration<double>(kReportS);
    while (Clock::now() < until) std::this_thread::sleep_for(std::chrono::milliseconds(20));
    end_job();
  }
  const std::vector<int> others = other_ranks();
  const std::vector<side::Reply> replies = side::ask(others, 'Q', std::to_string(g_rank), kAskS);
  std::vector<flight::Report> reports{flight::snapshot(g_rank, current_waits())};
  std::vector<int> silent, exited;
  int lowest = g_rank;
  for (size_t i = 0; i < others.size(); ++i) {
    const side::Reply& r = replies[i];
    if (r.state == side::State::exited) {
      exited.push_back(others[i]);
      continue;
    }
    try {
      if (r.state != side::State::answered) throw std::runtime_error("no answer");
      reports.push_back(flight::parse(r.body));
      lowest = std::min(lowest, others[i]);
    } catch (const std::exception&) {
      silent.push_back(others[i]);
    }
  }
  write_records();
  std::string line = flight::diagnose(reports, silent, exited, g_size, timeout_s);
  if (line.empty()) line = mine;  // no collective open anywhere (a wait for the GPU alone)
  if (lowest == g_rank) {
    print_once(line);
    // Another rank that timed out at the same moment may be sending its line here: answer it
    // (the line is printed once) rather than leave it to print its own.
    std::this_thread::sleep_for(std::chrono::duration<double>(2 * kAskS));
  } else if (side::ask({lowest}, 'P', line, kAskS)[0].state == side::State::silent) {
    print_once(line);  // (exited: it answered a moment ago, and has ended after its own report)
  }
  end_job();
}

// Ends the job when a hurried wait finds a peer whose process is gone (see hurry()).
[[noreturn]] void expire_dead(const Slot& s, const std::vector<int>& exited) {
  if (g_queried || g_printed) {  // the job is ending after a reported timeout: nothing to add
    write_records();
    end_job();
  }
  const char* what = s.what.load();
  std::string ranks;
  for (size_t i = 0; i < exited.size(); ++i) ranks += (i ? ", " : "") + std::to_string(exited[i]);
  print_once(fmt::format("rank {}: {} cannot complete after the stop request: rank{} {} {} exited. Ending the job.",
                         g_rank, what ? what : "a collective", exited.size() == 1 ? "" : "s", ranks,
                         exited.size() == 1 ? "has" : "have"));
  write_records();
  end_job();
}

void loop() {
  std::unique_lock lock(g_mu);
  long long last_probe = 0, last_tick = now_ns();
  while (!g_stop) {
    const long long timeout = g_timeout_ns.load();
    const auto period = std::chrono::nanoseconds(std::clamp(timeout / 20, 10'000'000LL, 250'000'000LL));
    g_cv.wait_for(lock, period, [] { return g_stop; });
    if (g_stop) break;
    const long long now = now_ns(), hurry = g_hurry_ns.load();
    if (now - last_tick > kStoppedGapS * 1e9) g_was_stopped = true;
    last_tick = now;
    const int used = std::min(g_used.load(), kSlots);
    for (int i = 0; i < used; ++i) {
      const Slot& s = g_slots[i];
      const long long start = s.start_ns.load();
      if (start == 0) continue;
      if (hurry != 0) {
        // A Patient's wait (the writers of a checkpoint) may outlast the grace; a peer gone for
        // good ends it all the same.
        const long long waited = now - std::max(start, hurry);
        if (waited > kHurryGraceS * 1e9 && g_patient.load() == 0)
          expire(s, fmt::format("has waited {:.0f} s since the stop was requested; a peer rank has probably died. "
                                "Ending the job.", kHurryGraceS).c_str());
        if (waited > kDeadProbeS * 1e9 && now - last_probe > kDeadProbeEveryS * 1e9 && side::ready()) {
          last_probe = now;
          const std::vector<int> others = other_ranks();
          const std::vector<side::Reply> replies = side::ask(others, 0, "", kProbeS);
          std::vector<int> exited;
          for (size_t k = 0; k < others.size(); ++k)
            if (replies[k].state == side::State::exited) exited.push_back(others[k]);
          if (!exited.empty()) expire_dead(s, exited);
        }
      }
      if (now - start > timeout) expire_timeout(s, static_cast<double>(timeout) / 1e9);
    }
  }
}
}  // namespace

void start(double timeout_s, int rank, int size) {
  g_rank = rank;
  g_size = size;
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
  write_records();
}

int open_side_channel() { return side::listen(&handle); }

void set_debug_dir(const std::string& dir) {
  std::lock_guard lock(g_dir_mu);
  g_debug_dir = dir;
}

void on_expire(void (*hook)()) { g_on_expire.store(hook); }

bool ending() { return g_ending.load(); }

void park() {
  for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
}

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
