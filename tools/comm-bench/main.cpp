// comm-bench: a collective-communication benchmark over MPI and NCCL (see man comm-bench).
#include <cstdlib>
#include <string>
#include <vector>

#include "dtk/cli/cli.h"
#include "dtk/cli/checks.h"
#include "dtk/core/checks.h"
#include "dtk/core/error.h"
#include "engine.h"

namespace {
using namespace dtk;

struct Args {
  std::string op = "allreduce", min = "8", max = "64M", step, dtype = "f32", redop = "sum", backend = "auto",
              device = "cpu", time = "mean", iters_json;
  double factor = 2;
  int iters = 20, warmup = 5, check = 1, root = 0;
  bool inplace = false, json = false, async = false, fit = false;
  std::vector<std::string> predict;
};

cli::Program program(Args& a) {
  cli::Program p;
  p.name = "comm-bench";
  p.description =
      "Collective-communication benchmark over MPI and NCCL: checks and times all-reduce, all-gather, "
      "reduce-scatter, broadcast, all-to-all and send/recv over a sweep of sizes.";
  p.footer =
      "Sizes take K, M, G suffixes (powers of 1024). busbw = algbw x bus factor: 2(n-1)/n for allreduce; "
      "(n-1)/n for allgather, reducescatter, alltoall; 1 for broadcast and sendrecv.\n"
      "Exit status: 0 all results right, 1 wrong results or a failure, 2 bad usage.\n"
      "Example: mpiexec -n 4 comm-bench --op all -b 8 -e 128M -f 4";
  p.add_options = [&a](CLI::App& app) {
    std::string ops = "allreduce, allgather, reducescatter, broadcast, alltoall, sendrecv or all";
    app.add_option("--op", a.op, ops);
    app.add_option("-b,--min-bytes", a.min, "smallest size");
    app.add_option("-e,--max-bytes", a.max, "largest size");
    auto* f = app.add_option("-f,--step-factor", a.factor, "multiply the size by this between runs");
    auto* i = app.add_option("-i,--step-bytes", a.step, "add this to the size between runs (instead of -f)");
    f->excludes(i);
    app.add_option("-n,--iters", a.iters, "timed iterations per size")->check(cli::at_least(1));
    app.add_option("-w,--warmup-iters", a.warmup, "untimed iterations per size")->check(cli::at_least(0));
    app.add_option("-c,--check-iters", a.check, "checked iterations per size (0: no check)")
        ->check(cli::at_least(0));
    app.add_option("-d,--dtype", a.dtype, "f32, f64, bf16, f16, i32, i64, u8 or u16");
    app.add_option("-o,--redop", a.redop, "sum, avg, max or min");
    app.add_option("-r,--root", a.root, "root rank of broadcast");
    app.add_option("--backend", a.backend, "mpi, nccl or auto (nccl for cuda buffers when available)");
    app.add_option("--device", a.device, "where the buffers live: cpu or cuda");
    app.add_flag("--inplace", a.inplace, "receive into the send buffer (MPI_IN_PLACE semantics)");
    app.add_flag("--async", a.async, "start each operation nonblocking and wait on its handle");
    app.add_option("--time", a.time, "how rank times combine: mean, min or max");
    app.add_flag("--json", a.json, "print one JSON document instead of the table");
    app.add_flag("--fit", a.fit,
                 "fit time = latency + bytes / bandwidth to each collective's sweep and print it "
                 "(least squares in relative error)");
    app.add_option("--predict", a.predict, "with --fit: predicted times at these sizes (comma-separated)")
        ->delimiter(',');
    app.add_option("--iters-json", a.iters_json,
                   "write every timed iteration's time on every rank to this JSON file (rank 0, at the end)")
        ->type_name("FILE");
  };
  p.validate = [&a](comm::Runtime& rt) -> cli::Work {
    bench::Options o;
    if (a.op == "all") {
      for (const auto& c : bench::collectives()) o.ops.push_back(&c);
    } else if (const auto* c = bench::find_collective(a.op)) {
      o.ops.push_back(c);
    } else {
      fail_usage("unknown --op '" + a.op + "' (expected allreduce, allgather, reducescatter, broadcast, alltoall, "
                 "sendrecv or all)");
    }
    o.min_bytes = cli::parse_size(a.min);
    o.max_bytes = cli::parse_size(a.max);
    if (o.min_bytes > o.max_bytes)
      fail_usage("--min-bytes " + a.min + " is larger than --max-bytes " + a.max);
    o.step = a.step.empty() ? 0 : cli::parse_size(a.step);
    if (!a.step.empty() && o.step == 0) fail_usage("--step-bytes must be positive");
    if (a.step.empty() && !(a.factor > 1)) fail_usage("--step-factor must be larger than 1");
    o.factor = a.factor;
    o.iters = a.iters;
    o.warmup = a.warmup;
    o.check = a.check;
    o.dtype = parse_dtype(a.dtype);
    o.redop = comm::parse_reduce_op(a.redop);
    if (a.root < 0 || a.root >= rt.size())
      fail_usage("--root {} is not a rank of this job of {}", a.root, rt.size());
    o.root = a.root;
    o.backend = comm::parse_backend(a.backend);
    o.device = parse_device(a.device);
    o.inplace = a.inplace;
    o.async = a.async;
    o.json = a.json;
    o.fit = a.fit;
    if (!a.predict.empty() && !a.fit) fail_usage("--predict needs --fit");
    for (const auto& sz : a.predict) o.predict.push_back(cli::parse_size(sz));
    if (a.time == "mean") o.agg = bench::TimeAgg::mean;
    else if (a.time == "min") o.agg = bench::TimeAgg::min;
    else if (a.time == "max") o.agg = bench::TimeAgg::max;
    else fail_usage("unknown --time '" + a.time + "' (expected mean, min or max)");

    if (!a.iters_json.empty()) {
      if (o.async && o.device.is_cuda())
        fail_usage("--iters-json does not fit --async --device cuda (the iterations queue up on the GPU, "
                   "where the host's clock cannot tell them apart)");
      // Checked on every rank, as --metrics is: rank 0 writes it, at the end.
      check_output_file("--iters-json", a.iters_json);
      o.iters_json = a.iters_json;
    }
    o.delay = bench::parse_delay(std::getenv(bench::kDelayEnv), rt.size());
    if (o.device.is_cuda()) cuda::require_gpu();
    if (o.backend == comm::Backend::nccl) {
      if (!o.device.is_cuda()) fail_usage("--backend nccl moves GPU buffers: add --device cuda");
#ifndef DTK_HAVE_NCCL
      fail_usage("--backend nccl: this comm-bench was built without NCCL");
#endif
    }
    if (o.backend == comm::Backend::local && rt.size() > 1)
      fail_usage("--backend local is a world of one, but this job has {} ranks", rt.size());
    const bool nccl = rt.resolve(o.backend, o.device) == comm::Backend::nccl;
    if (nccl && o.dtype == DType::u16)
      for (const auto* c : o.ops)
        if (c->reduces) fail_usage("NCCL cannot reduce u16 (--op " + std::string(c->name) + "); use another --dtype");
    return [o](comm::Runtime& rt) { return bench::run_benchmark(rt, o); };
  };
  return p;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  return dtk::cli::main(argc, argv, program(a));
}
