// A program that misbehaves on purpose, for tests/mpi/fault.sh: a rank that dies, hangs, or
// fails, while rank 0 waits in a collective. Built on cli::main like every dtk program.
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <optional>
#include <thread>

#include "dtk/cli/cli.h"
#include "dtk/comm/side_channel.h"
#include "dtk/comm/watchdog.h"
#include "dtk/core/error.h"

namespace {
using Clock = std::chrono::steady_clock;

// Short watched waits on this thread for `seconds`, each a few microseconds long.
void short_waits(const char* what, double seconds) {
  const auto end = Clock::now() + std::chrono::duration<double>(seconds);
  while (Clock::now() < end) {
    dtk::comm::watchdog::Scope scope(what, 8);
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}
}  // namespace

int main(int argc, char** argv) {
  static std::string mode;
  const dtk::cli::Work run = [](dtk::comm::Runtime& rt) {
    auto world = rt.world();
    const bool culprit = rt.rank() == rt.size() - 1;
    if (culprit && mode == "die") raise(SIGKILL);
    if (culprit && mode == "hang") sleep(120);
    if (culprit && mode == "fail-on-one") dtk::fail("a failure on the last rank only");
    // After a stop request, a peer whose process is gone (its side channel closed, as at its
    // death) ends the wait at once; a peer that is only stopped does not, and the stop's grace
    // of 5 s applies.
    // The same while a Patient lives (a checkpoint's gather from its writers): a dead peer still ends it.
    const bool gone = mode == "gone-at-stop" || mode == "gone-at-stop-patient";
    if (gone || mode == "stopped-at-stop") {
      if (culprit && gone) {
        dtk::comm::side::stop();
        sleep(60);
      }
      if (culprit) raise(SIGSTOP);
      dtk::comm::watchdog::hurry();
    }
    // A GPU that never finishes: the host's wait for it (the hook that cuda::wait_event takes)
    // must end the job as a hung collective does, after running the expiry hook (NCCL's aborts).
    if (!culprit && mode == "device-hang") sleep(1);  // the culprit's watchdog speaks first
    if (culprit && mode == "device-hang") {
      dtk::comm::watchdog::on_expire([] { std::fprintf(stderr, "comm-fault: the expiry hook ran\n"); });
      dtk::comm::wait_for_device("a wait for the GPU", 0, [](void*) { return false; }, nullptr);
    }
    // Two threads waiting at once, each in short waits (the caller and a communicator's thread):
    // neither may end the other's wait or leave a stale one behind, which the watchdog would
    // then take for a hang.
    if (mode == "overlapping-waits") {
      std::thread other(short_waits, "a wait on another thread", 3.0);
      short_waits("a wait on the main thread", 3.0);
      other.join();
    }
    std::optional<dtk::comm::watchdog::Patient> patient;
    if (mode == "gone-at-stop-patient") patient.emplace();
    double v = 1;
    world->all_reduce({&v, 1, dtk::DType::f64, {}}, {&v, 1, dtk::DType::f64, {}}, dtk::comm::ReduceOp::sum,
                      dtk::comm::Mode::sync).wait();
    return v == rt.size() ? 0 : 1;
  };
  dtk::cli::Program p;
  p.name = "comm-fault";
  p.description = "test program: one rank misbehaves";
  p.add_options = [](CLI::App& app) {
    app.add_option("--mode", mode, "die, hang, device-hang, overlapping-waits, gone-at-stop, gone-at-stop-patient, stopped-at-stop, usage-on-one, fail-on-one or ok")->required();
  };
  p.validate = [&run](dtk::comm::Runtime& rt) -> dtk::cli::Work {
    if (mode == "usage-on-one" && rt.rank() == rt.size() - 1) dtk::fail_usage("bad input seen on the last rank only");
    return run;
  };
  return dtk::cli::main(argc, argv, p);
}
