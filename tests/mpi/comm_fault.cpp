// A program that misbehaves on purpose, for tests/mpi/fault.sh: a rank that dies, hangs, or
// fails, while rank 0 waits in a collective. Built on cli::main like every dtk program.
#include <signal.h>
#include <unistd.h>

#include "dtk/cli/cli.h"
#include "dtk/core/error.h"

int main(int argc, char** argv) {
  static std::string mode;
  const dtk::cli::Work run = [](dtk::comm::Runtime& rt) {
    auto world = rt.world();
    const bool culprit = rt.rank() == rt.size() - 1;
    if (culprit && mode == "die") raise(SIGKILL);
    if (culprit && mode == "hang") sleep(120);
    if (culprit && mode == "fail-on-one") dtk::fail("a failure on the last rank only");
    double v = 1;
    world->all_reduce({&v, 1, dtk::DType::f64, {}}, {&v, 1, dtk::DType::f64, {}}, dtk::comm::ReduceOp::sum,
                      dtk::comm::Mode::sync);
    return v == rt.size() ? 0 : 1;
  };
  dtk::cli::Program p;
  p.name = "comm-fault";
  p.description = "test program: one rank misbehaves";
  p.add_options = [](CLI::App& app) {
    app.add_option("--mode", mode, "die, hang, usage-on-one, fail-on-one or ok")->required();
  };
  p.validate = [&run](dtk::comm::Runtime& rt) -> dtk::cli::Work {
    if (mode == "usage-on-one" && rt.rank() == rt.size() - 1) dtk::fail_usage("bad input seen on the last rank only");
    return run;
  };
  return dtk::cli::main(argc, argv, p);
}
