#include "dtk/cli/cli.h"

#include <fmt/format.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <thread>
#include <cstdlib>
#include <cstring>

#include "dtk/cli/checks.h"
#include "dtk/comm/watchdog.h"
#include "dtk/core/checks.h"
#include "dtk/cli/parse.h"
#include "dtk/core/error.h"

#ifndef DTK_VERSION
#define DTK_VERSION "0.0.0"
#endif

namespace dtk::cli {
namespace {

struct Common {
  std::string log_level = "info";
  bool log_all_ranks = false;
  double comm_timeout = 600;
  std::string debug_dir;
};

void setup_logging(const std::string& name, const Common& c, int rank) {
  auto sink = std::make_shared<spdlog::sinks::stderr_color_sink_mt>();
  auto logger = std::make_shared<spdlog::logger>(name, sink);
  logger->set_pattern(fmt::format("[%H:%M:%S.%e] [{} {}] %^%l%$: %v", name, rank));
  auto level = spdlog::level::from_str(c.log_level);
  // Other ranks stay quiet unless asked, but their warnings and errors always show.
  if (rank != 0 && !c.log_all_ranks) level = std::max(level, spdlog::level::warn);
  logger->set_level(level);
  logger->flush_on(spdlog::level::warn);
  spdlog::set_default_logger(logger);
}

// Runs f; returns its exit code, mapping exceptions to exit codes and a message. `agreed`, when
// given, is set when every rank raised the error together (AgreedError).
template <typename F>
int guarded(F&& f, std::string& message, bool* agreed = nullptr) {
  try {
    return f();
  } catch (const AgreedError& e) {
    message = e.what();
    if (agreed) *agreed = true;
    return e.exit_code();
  } catch (const UsageError& e) {
    message = e.what();
    return kExitUsage;
  } catch (const CLI::Error& e) {
    message = e.what();
    return kExitUsage;
  } catch (const std::exception& e) {
    message = e.what();
    return kExitFailure;
  }
}

// From the moment a rank knows how it ends, a stop signal (SIGTERM, SIGINT, SIGUSR1) ends it at
// once with that exit code instead of by the signal: first with the rank's own code, then with
// the one agreed over the ranks. Under `srun --kill-on-bad-exit=1` the first rank to exit with a
// status other than 0 (3 after a graceful stop, 2 after bad input) makes srun send SIGTERM to
// the others, which may still be in the agreement or in MPI_Finalize; killed there, they turned
// the job's status into 143 and a requeue chain of psgd-train.sbatch ended FAILED (on the test
// cluster, 2 of the first 15 stops). train::StopSignals handles the signals while training.
volatile std::sig_atomic_t g_exit_code = 0;
extern "C" void exit_with_code(int) { _exit(g_exit_code); }

int exit_on_stop_signal(int code) {
  g_exit_code = code;
  struct sigaction sa {};
  sa.sa_handler = exit_with_code;
  sigemptyset(&sa.sa_mask);
  for (const int sig : {SIGTERM, SIGINT, SIGUSR1}) sigaction(sig, &sa, nullptr);
  return code;
}

}  // namespace

void mark_launched(int rank) {
  static bool marked = false;
  const char* path = std::getenv("DTK_LAUNCH_MARK");
  if (marked || rank != 0 || path == nullptr || *path == '\0') return;
  marked = true;
  FILE* f = std::fopen(path, "w");
  if (f == nullptr || std::fclose(f) != 0)
    spdlog::warn("DTK_LAUNCH_MARK {}: cannot create it ({}); a later failure of this job will be taken for a failed "
                 "launch", path, std::strerror(errno));
}

std::string version_string(const std::string& program) {
  return program + " (dtk) " DTK_VERSION;
}

std::string build_info() { return "CUDA: " + cuda::describe() + "; NCCL: " + comm::nccl_version(); }

namespace {
// Everything between a good launch and the exit; returns the exit code, agreed over the ranks
// (or ends the job itself). Its locals (the parser, the work) are gone when it returns.
int run(int argc, char** argv, const Program& p, comm::Runtime* rt, const std::string& kernels) {
  std::string message;
  int code = kExitOk;
  const int rank = rt->rank();

  CLI::App app{p.description, p.name};
  app.footer(p.footer);
  app.set_version_flag("--version", std::function<std::string()>([&] {
    return version_string(p.name) + "\n" + build_info() + (kernels.empty() ? "" : "\n" + kernels);
  }));
  const auto toml_config = use_toml_config(app);
  Common common;
  app.add_option("--log-level", common.log_level, "trace, debug, info, warn, error or off")
      ->check(CLI::IsMember({"trace", "debug", "info", "warn", "error", "critical", "off"}))
      ->group("Common");
  app.add_flag("--log-all-ranks", common.log_all_ranks, "log from every rank, not only rank 0")->group("Common");
  app.add_option("--comm-timeout", common.comm_timeout,
                 "seconds a collective may take before the job is ended as hung")
      ->check(positive())
      ->group("Common");
  app.add_option("--debug-dir", common.debug_dir,
                 "write each rank's flight records (its last collectives: dtk-flight(5)) to "
                 "DIR/flight-rank-NNNNN.json when it ends and when a collective times out")
      ->type_name("DIR")
      ->group("Common");
  if (p.add_options) p.add_options(app);

  const std::vector<std::string> args(argv + 1, argv + argc);
  try {
    parse_args(app, argc, argv);
  } catch (const CLI::ParseError& e) {
    // Every rank parses the same arguments; rank 0 speaks. --help and --version exit 0.
    if (rank == 0) {
      if (e.get_exit_code() == 0)
        app.exit(e);
      else if (const auto [line, help] = parse_error_line(app, e, args, toml_config.get()); help)
        std::fprintf(stderr, "%s: error: %s (see --help)\n", p.name.c_str(), line.c_str());
      else
        std::fprintf(stderr, "%s: error: %s\n", p.name.c_str(), line.c_str());
    }
    const int agreed_code = exit_on_stop_signal(rt->max_over_ranks(exit_on_stop_signal(e.get_exit_code() == 0 ? kExitOk : kExitUsage)));
    if (agreed_code == kExitOk) mark_launched(rank);  // --help, --version: done, not a failed launch
    return agreed_code;
  }
  rt->set_timeout(common.comm_timeout);
  setup_logging(p.name, common, rank);

  // Phase 1: validation, no communication; every rank learns the worst outcome.
  Work work;
  code = guarded([&] {
    if (!common.debug_dir.empty()) check_output_dir("--debug-dir", common.debug_dir);
    work = p.validate(*rt);
    return 0;
  }, message);
  if (code != kExitOk) exit_on_stop_signal(code);
  const int worst = rt->max_over_ranks(code);
  if (worst != kExitOk) {
    exit_on_stop_signal(worst);
    const int rank0 = rt->broadcast_int(code, 0);
    if (code != kExitOk && (rank == 0 || rank0 == kExitOk || common.log_all_ranks))
      spdlog::error("{}", message);
    spdlog::default_logger()->flush();
    return worst;
  }

  if (!common.debug_dir.empty()) {
    std::error_code ec;  // every rank creates it; a rank that finds it made already is fine
    std::filesystem::create_directories(common.debug_dir, ec);
    comm::watchdog::set_debug_dir(common.debug_dir);
  }
  if (!p.marks_launch) mark_launched(rank);

  // Phase 2: the work. An error every rank raised together ends them all normally (rank 0 says
  // it); any other error on one rank ends the job.
  bool agreed = false;
  code = exit_on_stop_signal(guarded([&] { return work(*rt); }, message, &agreed));
  if (agreed) {
    if (rank == 0 || common.log_all_ranks) spdlog::error("{}", message);
    spdlog::default_logger()->flush();
    std::fflush(stdout);
    return exit_on_stop_signal(rt->max_over_ranks(code));
  }
  if (!message.empty()) {
    spdlog::error("{}", message);
    spdlog::default_logger()->flush();
    std::fflush(stdout);
    if (rt->size() > 1) rt->abort(code);
    return code;
  }
  std::fflush(stdout);
  const int agreed_code = exit_on_stop_signal(rt->max_over_ranks(code));
  if (agreed_code == kExitOk) mark_launched(rank);  // done (with nothing to do, too): launched
  return agreed_code;
}

// The testing aid DTK_TEST_EXIT_DELAY=RANK:SECONDS holds that rank back for SECONDS before it
// finishes MPI, as the scheduler holds a rank back on a loaded node.
void test_exit_delay(int rank) {
  const char* v = std::getenv("DTK_TEST_EXIT_DELAY");
  int r = -1;
  double s = 0;
  if (v != nullptr && std::sscanf(v, "%d:%lf", &r, &s) == 2 && r == rank && s > 0)
    std::this_thread::sleep_for(std::chrono::duration<double>(s));
}
}  // namespace

int main(int argc, char** argv, const Program& p) {
  const std::string kernels = p.cpu_kernels ? p.cpu_kernels(argv) : "";  // first: it may execute the program again
  auto rt = std::make_unique<comm::Runtime>(&argc, &argv, comm::Runtime::Options{});
  std::string message;
  const int launch = guarded([&] { rt->check_launch(); return 0; }, message);
  if (launch != kExitOk) {  // a misconfigured launch: every rank 0 says so (each process its own world: each)
    if (rt->rank() == 0) std::fprintf(stderr, "%s: error: %s\n", p.name.c_str(), message.c_str());
    return launch;
  }
  const int code = run(argc, argv, p, rt.get(), kernels);
  if (code == kExitOk) return code;  // a zero exit races nothing: the process ends as usual
  // A non-zero exit: the ranks leave together (comm::Runtime::finish), then at once, before
  // static destructors and atexit handlers could keep a rank for the launcher's kill.
  test_exit_delay(rt->rank());
  rt->finish(code);
  spdlog::debug("done with MPI on every rank; exit status {}", code);
  spdlog::default_logger()->flush();
  std::fflush(nullptr);
  _exit(code);
}

uint64_t parse_size(std::string_view s) {
  const std::string orig(s);
  double v = 0;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || v < 0) fail_usage("bad size '" + orig + "' (expected a number with an optional K, M or G)");
  std::string_view suffix(p, s.data() + s.size() - p);
  uint64_t mult = 1;
  if (!suffix.empty()) {
    const char c = static_cast<char>(std::toupper(static_cast<unsigned char>(suffix[0])));
    mult = c == 'K' ? 1ull << 10 : c == 'M' ? 1ull << 20 : c == 'G' ? 1ull << 30 : c == 'T' ? 1ull << 40 : 0;
    if (c == 'B' && suffix.size() == 1) mult = 1;
    auto rest = suffix.substr(1);
    if (mult == 0 || !(rest.empty() || rest == "B" || rest == "iB" || (c == 'B')))
      fail_usage("bad size '" + orig + "' (suffixes: K, M, G, T, optionally followed by B or iB)");
  }
  const double bytes = v * static_cast<double>(mult);
  if (bytes != std::floor(bytes)) fail_usage("size '" + orig + "' is not a whole number of bytes");
  return static_cast<uint64_t>(bytes);
}

std::string format_size(uint64_t b) {
  const char* units[] = {"", "K", "M", "G", "T"};
  int u = 0;
  double v = static_cast<double>(b);
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  char buf[32];
  if (v == std::floor(v))
    std::snprintf(buf, sizeof buf, "%.0f%s", v, units[u]);
  else
    std::snprintf(buf, sizeof buf, "%.1f%s", v, units[u]);
  return buf;
}

}  // namespace dtk::cli
