// What every dtk program shares: CLI11 set-up (--help, --version, --config FILE), logging on
// stderr (rank 0 unless --log-all-ranks), --comm-timeout, --debug-dir (the flight records,
// comm/watchdog.h), and exit codes that every rank agrees on.
//
// A program runs in two phases. validate() checks options and inputs without communicating and
// returns the work, holding what it resolved (the options stay as parsed); any rank's
// UsageError ends every rank with exit 2, cleanly. The work's return value is agreed (the
// maximum over ranks). An exception in the work on one rank cannot be agreed on (the others may
// be inside a collective), so with more than one rank it ends the job through MPI_Abort with the
// exception's exit code.
//
// A program's options are plain values owned by its main(), which add_options binds and
// validate reads: `Args a; return cli::main(argc, argv, program(a));`.
#pragma once
#include <CLI/CLI.hpp>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

#include "dtk/cli/checks.h"
#include "dtk/comm/comm.h"

namespace dtk::cli {

// The exit codes of every dtk program, the same on every rank.
inline constexpr int kExitOk = 0;
inline constexpr int kExitFailure = 1;  // a failure while running
inline constexpr int kExitUsage = 2;    // bad usage or bad input, found before anything is written
// A *-train run stopped early by a signal (train/stop.h) after its step: with --checkpoint-dir
// or --save its checkpoint is written and --resume continues it.
inline constexpr int kExitStopped = 3;
inline const std::string kExitStoppedHelp =
    "3 stopped by SIGTERM, SIGINT or SIGUSR1 after the step in progress, its checkpoint written (--resume or "
    "--auto-resume continues)";

using Work = std::function<int(comm::Runtime&)>;

struct Program {
  std::string name;
  std::string description;
  std::string footer;  // shown after the options in --help (examples, exit codes)
  std::function<void(CLI::App&)> add_options;
  std::function<Work(comm::Runtime&)> validate;
  // The work calls mark_launched itself (the *-train programs: after their first step); else
  // main() does, once every rank has validated its options.
  bool marks_launch = false;
  // A program that computes on the CPU: ops::select_cpu_kernels (ops/kernels.h), which main()
  // calls first, before MPI starts (it may execute the program again, once, with better BLAS
  // kernels); --version ends with the lines it returns.
  std::string (*cpu_kernels)(char** argv) = nullptr;
};

// share/dtk/slurm/*.sbatch tell a launch that failed (a task killed in its start-up, inside Open
// MPI, PMIx or SLURM: requeued) from a failure of the program (not requeued) by a file: when the
// environment names one in DTK_LAUNCH_MARK, rank 0 creates it once the job is past its start-up,
// and at the latest when the ranks agree on exit status 0 (a job that exits 0 without it did not
// run: srun exits 0 when its tasks failed to launch). Only the first call does anything.
void mark_launched(int rank);

// The whole main() of a program: `int main(int c, char** v) { return dtk::cli::main(c, v, program()); }`
int main(int argc, char** argv, const Program& program);

std::string version_string(const std::string& program);  // "psgd-train (dtk) 0.1.0"
// The CUDA backend, NCCL and the GPUs this process sees (--version's second line).
std::string build_info();

}  // namespace dtk::cli
