// psgd-train: data-parallel training with PowerSGD gradient compression (see man psgd-train).
#include "dtk/cli/cli.h"
#include "dtk/core/checks.h"
#include "dtk/core/error.h"
#include "dtk/train/trainer.h"

namespace {
using namespace dtk;

cli::Program program() {
  static train::Options o;
  static compress::Config c;
  static std::string comm_dtype = "f32";
  static bool no_warm_start = false, no_error_feedback = false;
  cli::Program p;
  p.name = "psgd-train";
  p.description =
      "Data-parallel training with PowerSGD gradient compression (Vogels et al., 2019): rank-r power iteration "
      "with warm start and error feedback, aggregated by all-reduce; plain, top-k, random-k and signum "
      "aggregation as baselines.";
  p.footer =
      train::metrics_help("comm_bytes_uncompressed, compression_ratio (with a compressor other than none)") +
      "Exit status: 0 done, 1 a failure while training, 2 bad usage or bad input, " + train::kExitStoppedHelp + ".\n"
      "Example: mpiexec -n 4 psgd-train --model llama-tiny --data synthetic --compressor powersgd --rank 2 --steps 300";
  p.add_options = [](CLI::App& app) {
    train::add_options(app, o);
    const char* g = "Compression";
    app.add_option("--compressor", c.kind, "powersgd, none (bucketed all-reduce), topk, randomk or signum")
        ->group(g)->check(CLI::IsMember({"powersgd", "none", "topk", "randomk", "signum"}));
    app.add_option("--rank", c.rank, "PowerSGD rank r")->group(g)->check(cli::at_least(1));
    app.add_option("--start-iter", c.start_iter, "plain all-reduce for the first K steps")
        ->group(g)->check(cli::at_least(0));
    app.add_option("--min-compression-rate", c.min_compression_rate,
                   "compress a matrix only when it shrinks at least this much")->group(g)->check(cli::positive());
    app.add_flag("--no-warm-start", no_warm_start, "draw a new Q every step instead of reusing the last")->group(g);
    app.add_flag("--no-error-feedback", no_error_feedback, "drop what the compression leaves out")->group(g);
    app.add_option("--error-mode", c.error_mode,
                   "error feedback: projection (M - P(P^T M), bounded per rank) or full (M - P Q^T)")
        ->group(g)->check(CLI::IsMember({"projection", "full"}));
    app.add_option("--orthogonalize", c.orthogonalize, "auto (Gram-Schmidt for rank <= 2, QR above), mgs or qr")
        ->group(g)->check(CLI::IsMember({"auto", "mgs", "qr"}));
    app.add_option("--comm-dtype", comm_dtype, "P and Q on the wire: f32 or bf16")
        ->group(g)->check(CLI::IsMember({"f32", "bf16"}));
    app.add_option("--compress-ratio", c.ratio, "topk/randomk: fraction of each gradient's coordinates sent")
        ->group(g)->check(cli::positive())->check(cli::at_most(1));
  };
  p.validate = [](comm::Runtime& rt) { train::validate(o, rt.size()); };
  p.run = [](comm::Runtime& rt) {
    c.warm_start = !no_warm_start;
    c.error_feedback = !no_error_feedback;
    c.comm_dtype = parse_dtype(comm_dtype);
    c.seed = o.seed;
    train::Strategy s;
    s.program = "psgd-train";
    s.config = c.to_json();
    if (c.kind != "none")
      s.compressor = [](comm::Communicator& comm, const std::vector<nn::Param>& params, size_t bucket_bytes) {
        return compress::make_compressor(c, comm, params, bucket_bytes);
      };
    return train::run(o, s, rt);
  };
  return p;
}

}  // namespace

int main(int argc, char** argv) { return dtk::cli::main(argc, argv, program()); }
