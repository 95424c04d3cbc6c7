#include "dtk/train/command_line.h"

#include <algorithm>
#include <charconv>
#include <set>

#include "dtk/cli/checks.h"
#include "dtk/nn/model.h"
#include "dtk/train/metrics.h"

namespace dtk::train {

using namespace cli;  // the option helpers: add_enum, add_size, one_of, at_least ...
namespace {

// The options that define a run, which a resumed run keeps from its checkpoint unless they are
// given again: every option of these groups, and --sync-batchnorm. The model's sizes are the
// checkpoint's anyway (train::resolve_model); where and how the run executes (--device,
// --threads, outputs, evaluation, --stop-at) is each command line's own.
constexpr std::string_view kRunGroups[] = {"Data", "Optimization", "Shampoo", "Compression", "Synchronisation", "Precision"};

// The options that shape the state a checkpoint holds (an optimizer's, a compressor's), each marked
// where it is declared (shapes_state): a resume cannot change them (train::validate refuses).
std::set<std::string>& state_shaping() {
  static std::set<std::string> names;
  return names;
}
CLI::Option* shapes_state(CLI::Option* opt) {
  state_shaping().insert(opt->get_name());
  return opt;
}

bool kept_on_resume(const CLI::Option& opt) {
  const std::string name = opt.get_name();
  if (name == "--stop-at") return false;
  if (name == "--sync-batchnorm") return true;
  return std::find(std::begin(kRunGroups), std::end(kRunGroups), opt.get_group()) != std::end(kRunGroups);
}

// Two values of an option as typed: the same number however written (3e-4, 0.0003), else the
// same text.
bool same_value(const std::vector<std::string>& a, const std::vector<std::string>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    double x = 0, y = 0;
    const auto [pa, ea] = std::from_chars(a[i].data(), a[i].data() + a[i].size(), x);
    const auto [pb, eb] = std::from_chars(b[i].data(), b[i].data() + b[i].size(), y);
    const bool numbers = ea == std::errc() && eb == std::errc() && pa == a[i].data() + a[i].size() &&
                         pb == b[i].data() + b[i].size();
    if (numbers ? x != y : a[i] != b[i]) return false;
  }
  return true;
}

std::string joined(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : ",") + x;
  return s;
}

// The value an option has when not given: its default, "false" for a flag.
std::vector<std::string> default_value(const CLI::Option& opt) {
  if (opt.get_expected_min() == 0) return {"false"};
  const std::string d = opt.get_default_str();
  if (d.empty() || d == "[]") return {};
  return {d};
}

// After parsing: a resumed run takes the checkpoint's run options that are not given again (as
// if they were), and every option given again with another value is listed in
// o.resume_changes; then o.run_options records the run's options for its checkpoints.
void keep_checkpoint_options(CLI::App& app, train::Options& o) {
  nlohmann::json then;
  try {
    then = train::resumed_run_options(o);
  } catch (const std::exception&) {
    then = nullptr;  // a checkpoint that cannot be read: validation says so
  }
  if (then.is_object()) {
    for (CLI::Option* opt : app.get_options()) {
      if (!kept_on_resume(*opt)) continue;
      const std::string name = opt->get_name();
      const auto it = then.find(name);
      const std::vector<std::string> before =
          it != then.end() ? it->get<std::vector<std::string>>() : default_value(*opt);
      if (opt->count() > 0) {
        // Given in place of an option of the run that it excludes (--steps for its --epochs).
        std::string other;
        for (const CLI::Option* x : opt->get_excludes())
          if (const auto xt = then.find(x->get_name()); xt != then.end())
            other = x->get_name() + " " + joined(xt->get<std::vector<std::string>>());
        if (!other.empty())
          o.resume_changes.push_back({name, joined(opt->reduced_results()), other, state_shaping().count(name) > 0});
        else if (!same_value(opt->reduced_results(), before))
          o.resume_changes.push_back({name, joined(opt->reduced_results()), before.empty() ? "unset" : joined(before),
                                      state_shaping().count(name) > 0});
        continue;
      }
      if (it == then.end()) continue;
      // Not over an option given now that excludes it (--steps given again, the run had --epochs).
      const auto ex = opt->get_excludes();
      if (std::any_of(ex.begin(), ex.end(), [](const CLI::Option* x) { return x->count() > 0; })) continue;
      opt->clear();
      opt->add_result(before);
      opt->run_callback();
    }
  }
  o.run_options = nlohmann::json::object();
  for (const CLI::Option* opt : app.get_options())
    if (kept_on_resume(*opt) && opt->count() > 0) o.run_options[opt->get_name()] = opt->reduced_results();  // a repeated option: its last value
}

}  // namespace

void add_options(CLI::App& app, train::Options& o) {
  const char* g = "Model";
  app.add_option("--model", o.model.preset, "model preset: " + [] {
    std::string s;
    for (const auto& n : nn::preset_names()) s += (s.empty() ? "" : ", ") + n;
    return s;
  }() + " (default llama-tiny, or the checkpoint's model with --resume/--init-from)")->group(g);
  app.add_option("--dim", o.model.dim, "model width (llama)")->group(g)->check(cli::at_least(1));
  app.add_option("--layers", o.model.layers, "number of layers (llama: blocks; mlp: hidden layers, each --dim wide)")
      ->group(g)->check(cli::at_least(1));
  app.add_option("--heads", o.model.heads, "attention heads")->group(g)->check(cli::at_least(1));
  app.add_option("--kv-heads", o.model.kv_heads, "key/value heads (grouped-query attention)")->group(g)->check(cli::at_least(1));
  app.add_option("--ffn-hidden", o.model.ffn_hidden, "SwiGLU hidden size")->group(g)->check(cli::at_least(1));
  app.add_option("--vocab", o.model.vocab, "vocabulary size")->group(g)->check(cli::at_least(1));
  app.add_option("--seq-len", o.model.seq_len, "tokens per sample")->group(g)->check(cli::at_least(1));
  app.add_option("--input-dim", o.model.input_dim, "inputs per sample (mlp; 3072 for CIFAR-10)")->group(g)->check(cli::at_least(1));
  app.add_option("--input-shape", o.model.input_shape,
                 "C,H,W of the input images (resnet; default: the --data file's images, else 3,32,32)")
      ->group(g)->delimiter(',')->expected(3)->check(cli::at_least(1))->type_name("C,H,W")->default_str("");
  app.add_option("--classes", o.model.classes, "number of classes (mlp, resnet)")->group(g)->check(cli::at_least(1));
  app.add_flag("--sync-batchnorm", o.model.sync_batchnorm,
               "batch norm statistics over every rank's share of the batch (SyncBatchNorm); default: each rank's "
               "own, as DDP (resnet)")->group(g);
  app.add_option_function<std::string>(
         "--activation-checkpointing",
         [&o](const std::string& v) {
           o.model.activation_checkpointing =
               v.empty() ? nn::Checkpointing::full : parse_enum<nn::Checkpointing>(v, "--activation-checkpointing");
         },
         "recompute in backward instead of keeping activations: full, each layer's (resnet: residual block's) "
         "forward (the bare flag); selective, only what is cheap (matmul and attention outputs kept; resnet: "
         "convolution outputs kept)")
      ->expected(0, 1)->type_name("[TEXT:" + one_of<nn::Checkpointing>().get_description() + "]")
      ->default_str("none")->group(g);

  g = "Data";
  app.add_option("--data", o.data.train,
                 "training data: synthetic (embedded, no files), an HDF5 file from data-pack, or token shards as one "
                 "stream: a .npy or llm.c .bin file, a quoted glob ('dir/train-*.bin'), a list file (*.txt, *.list)")
      ->group(g);
  app.add_option("--val-data", o.data.val, "validation data, as --data takes it (synthetic data has its own validation "
                 "stream)")->group(g);
  app.add_option("--global-batch", o.data.global_batch, "samples per step over all ranks")->group(g)->check(cli::at_least(1));
  app.add_option("--micro-batch", o.data.micro_batch, "samples per forward/backward on a rank (0: the rank's whole share)")
      ->group(g)->check(cli::at_least(0));
  add_enum(app, "--augment", o.data.augment,
           "training-time augmentation of image data: crop-flip is a random crop of the image padded by 4 pixels "
           "and a horizontal flip with probability 1/2, each sample's draw a function of the seed, the step and the "
           "sample")->group(g);

  g = "Optimization";
  CLI::Option* steps = app.add_option("--steps", o.schedule.steps, "training steps")->group(g)->check(cli::at_least(1));
  app.add_option("--epochs", o.schedule.epochs,
                 "training length in passes over --data instead of --steps: epochs x samples / --global-batch "
                 "steps, rounded up")
      ->group(g)->check(cli::positive())->excludes(steps);
  app.add_option("--stop-at", o.schedule.stop_at,
                 "stop after this step, writing a checkpoint, as if the job ended there (the schedule still "
                 "spans --steps); --resume continues")->group(g)->check(cli::at_least(0));
  app.add_option("--lr", o.schedule.lr, "peak learning rate")->group(g)->check(cli::positive());
  add_enum(app, "--schedule", o.schedule.kind, "learning-rate schedule after warm-up (step: --decay-steps)")->group(g);
  app.add_option("--warmup", o.schedule.warmup, "linear warm-up steps")->group(g)->check(cli::at_least(0));
  app.add_option("--min-lr-ratio", o.schedule.min_lr_ratio, "final learning rate of linear/cosine decay, as a fraction of --lr")
      ->group(g)->check(cli::between(0, 1));
  CLI::Option* decay = app.add_option("--decay-steps", o.schedule.decay_steps,
                 "--schedule step: the steps (comma-separated, increasing) from which the learning rate is "
                 "multiplied by --decay-factor once more")
      ->group(g)->delimiter(',')->check(cli::at_least(1));
  app.add_option("--decay-epochs", o.schedule.decay_epochs,
                 "--schedule step: the decay points in epochs instead of steps (each rounded to the nearest step)")
      ->group(g)->delimiter(',')->check(cli::positive())->excludes(decay);
  app.add_option("--decay-factor", o.schedule.decay_factor, "--schedule step: the factor of each decay (default 0.1)")
      ->group(g)->check(cli::positive());
  app.add_option("--clip", o.optimization.clip, "clip gradients to this global L2 norm (0: off)")->group(g)->check(cli::at_least(0));
  shapes_state(add_enum(app, "--optimizer", o.optimization.optimizer,
                        "the optimizer (shampoo with its defaults where the program has no Shampoo options)"))->group(g);
  app.add_option("--momentum", o.optimization.momentum, "momentum (SGD: default 0.9; Shampoo: on the search direction, default none)")
      ->group(g)->check(cli::between(0, 1));
  app.add_flag("--nesterov", o.optimization.nesterov, "Nesterov momentum (SGD, Shampoo)")->group(g);
  app.add_option("--weight-decay", o.optimization.weight_decay, "weight decay (AdamW: decoupled)")->group(g)->check(cli::at_least(0));
  app.add_option("--beta1", o.optimization.beta1, "AdamW beta1")->group(g)->check(cli::between(0, 1));
  app.add_option("--beta2", o.optimization.beta2, "AdamW beta2")->group(g)->check(cli::between(0, 1));
  app.add_option("--eps", o.optimization.eps, "AdamW epsilon")->group(g)->check(cli::positive());
  app.add_option("--seed", o.data.seed, "seed of initialisation, data order and synthetic data")->group(g);

  g = "Precision";
  add_enum(app, "--precision", o.model.precision,
           "the model's arithmetic: f32, true f32 products; tf32, the weight products (linear layers, "
           "convolutions) with each operand rounded to TF32 (10 mantissa bits) and f32 sums, on the GPU's tensor "
           "cores as PyTorch's allow_tf32; bf16, mixed precision as PyTorch's autocast with bf16 parameters: the "
           "layers compute with a bf16 copy of the weights, bf16 operands and f32 sums, llama's activations in "
           "bf16 with its residual stream, norm statistics, softmax and loss in f32 (the mlp keeps f32 "
           "activations, resnet f32 weights with bf16-rounded operands). The CPU rounds at the same points, at no "
           "gain in speed. Master weights, gradients and optimizer state stay f32 in every precision; optimizers "
           "and compressors always multiply in f32")
      ->group(g);

  g = "Run";
  app.add_option("--device", o.runtime.device, "cpu or cuda (each rank uses GPU local_rank % device count)")->group(g);
  add_enum(app, "--backend", o.runtime.backend,
           "the collectives' backend (auto: nccl for --device cuda where NCCL exists, else mpi; mpi with --device "
           "cuda stages GPU buffers through host memory, and lets ranks share a GPU)",
           {comm::Backend::automatic, comm::Backend::mpi, comm::Backend::nccl})->group(g);
  app.add_option("--threads", o.runtime.threads,
                 "CPU threads per rank (default: OMP_NUM_THREADS if set, else the cores the launcher bound the "
                 "rank to, else the node's cores shared among its ranks)")->group(g)->check(cli::at_least(1));
  add_size(app, "--bucket-size", o.runtime.bucket_bytes, "gradient all-reduce bucket size")->group(g);
  app.add_option("--eval-every", o.evaluation.every, "validation loss every K steps (0: only at the end)")
      ->group(g)->check(cli::at_least(0));
  app.add_option("--eval-batches", o.evaluation.batches, "global batches per validation")->group(g)->check(cli::at_least(1));
  app.add_option("--log-every", o.runtime.log_every, "a log line every K steps when stderr is not a terminal")
      ->group(g)->check(cli::at_least(1));
  app.add_option("--metrics", o.runtime.metrics,
                 "JSON-lines metrics file (- for stdout, which then carries nothing else). An existing file is "
                 "refused, unless the run resumes: then its lines up to the checkpoint's step are kept and the "
                 "run's follow")->group(g);
  app.add_flag("--metrics-append", o.runtime.metrics_append, "add to an existing --metrics file as it is")->group(g);
  app.add_flag("--print-plan", o.runtime.print_plan,
               "print the run's plan as JSON once it is final, then exit without training further or saving: "
               "fsdp-train's bucket plan with its predicted exposed communication (after calibrating the "
               "collectives and timing two steps), --compressor auto's first decisions (made at --start-iter), "
               "Shampoo's blocks and their owners; checkpoint options are ignored")->group(g);
  app.add_option("--checkpoint-dir", o.checkpoint.dir, "write checkpoints step-NNNNNNNN.h5 here, with a `latest` file")->group(g);
  app.add_option("--checkpoint-every", o.checkpoint.every, "checkpoint every K steps (0: only at the end)")
      ->group(g)->check(cli::at_least(0));
  app.add_option("--keep", o.checkpoint.keep, "checkpoints kept in --checkpoint-dir")->group(g)->check(cli::at_least(1));
  app.add_flag("--async-checkpoint,!--no-async-checkpoint", o.checkpoint.async,
               "write --checkpoint-dir's checkpoints in the background: the step waits only for a copy of the "
               "state in host memory, the next checkpoint (and the end) for the write (the default; "
               "--no-async-checkpoint or --async-checkpoint=false: the step waits for the write)")->group(g);
  app.add_option("--save", o.checkpoint.save, "write the final checkpoint to this file")->group(g);
  auto* r = app.add_option("--resume", o.checkpoint.resume,
                           "continue a run exactly from a checkpoint file or a --checkpoint-dir (its latest): the "
                           "options of groups Data, Optimization, Shampoo, Compression and Precision are the "
                           "checkpoint's unless given again (a warning names those that differ); on another number "
                           "of ranks it continues as if the run had had them throughout (a warning names what cannot)")
               ->group(g);
  auto* i = app.add_option("--init-from", o.checkpoint.init_from, "start from the weights only of a checkpoint, or of a Hugging Face Llama folder (config.json and "
                           "safetensors, as transformers saves it; its config sets the model)")->group(g);
  r->excludes(i);
  app.add_flag("--auto-resume", o.checkpoint.auto_resume,
               "continue from --checkpoint-dir's latest checkpoint when it has one (over --init-from), else start "
               "as asked: a job can be resubmitted or requeued unchanged")->group(g)->excludes(r);
  app.final_callback([&app, &o] { keep_checkpoint_options(app, o); });
}

std::string metrics_help(std::initializer_list<train::MetricSource> added) {
  std::string s = "Metrics (JSON lines on stdout or --metrics):";
  const char* sep = " ";
  for (const auto& k : train::kMetricKeys) {
    if (k.source != train::MetricSource::loop && std::find(added.begin(), added.end(), k.source) == added.end()) continue;
    s += sep + std::string(k.name) + (k.when.empty() ? "" : " (" + std::string(k.when) + ")");
    sep = ", ";
  }
  return s + ".\n";
}

void add_shampoo_options(CLI::App& app, optim::ShampooConfig& c) {
  const char* g = "Shampoo";
  add_enum(app, "--preconditioner", c.preconditioner,
           "root: inverse roots of the Kronecker factors (Shampoo); eigenvalue-corrected: Adam in the factors' "
           "eigenbases (SOAP); spectral: the orthogonalised filtered gradient of each matrix block (Muon); dion: "
           "Muon's update of each whole matrix by a rank-r power iteration with error feedback (Dion)")->group(g);
  shapes_state(app.add_option("--max-preconditioner-dim", c.max_preconditioner_dim,
                              "merge dims while their product stays below this, and split dims into blocks of at most it"))
      ->group(g)->check(cli::at_least(1));
  app.add_option("--precondition-frequency", c.precondition_frequency,
                 "recompute the inverse roots (eigenvalue-corrected: the eigenbases) every K steps")
      ->group(g)->check(cli::at_least(1));
  app.add_option("--factor-update-every", c.factor_update_every,
                 "the Kronecker factors take the gradient of every K-th step only (Google's statistics_compute_steps; "
                 "not in Meta's reference)")->group(g)->check(cli::at_least(1));
  app.add_option("--start-preconditioning-step", c.start_preconditioning_step,
                 "grafting alone before this step (-1: --precondition-frequency)")->group(g);
  app.add_option("--shampoo-epsilon", c.epsilon, "added to the factors' eigenvalues")->group(g)->check(cli::at_least(0));
  shapes_state(add_enum(app, "--factor-dtype", c.factor_dtype, "the Kronecker factors' precision", {DType::f32, DType::f64}))
      ->group(g);
  app.add_option("--exponent-override", c.exponent_override, "root F^(-1/x) instead of F^(-1/(2 order)) (0: off)")
      ->group(g)->check(cli::at_least(0));
  add_enum(app, "--root-method", c.root_method,
           "inverse roots by eigh, (coupled) newton iteration, qr: eigh warm-started from the previous "
           "eigenbasis by QR iterations, or pseudo-inverse: eigh with eigenvalues below a rank cutoff dropped "
           "(no epsilon); eigenvalue-corrected: its eigenbases by eigh or qr (Meta's SOAP: QR iterations from the "
           "previous bases, the first time from the identity)")->group(g);
  app.add_option("--rank-rtol", c.rank_rtol,
                 "pseudo-inverse: eigenvalues at or below this fraction of the largest are dropped (< 0: n times the "
                 "machine epsilon)")->group(g);
  app.add_option("--rank-atol", c.rank_atol, "pseudo-inverse: and those at or below this")->group(g)->check(cli::at_least(0));
  app.add_option("--ec-beta2", c.ec_beta2,
                 "eigenvalue-corrected: decay of the second moment in the eigenbases (< 0: --beta2)")->group(g);
  app.add_option("--ec-epsilon", c.ec_epsilon,
                 "eigenvalue-corrected: added to the second moment's square root (< 0: --shampoo-epsilon)")->group(g);
  shapes_state(add_enum(app, "--basis-dtype", c.basis_dtype,
                        "eigenvalue-corrected: the precision of the eigenbases and of the second moment in them",
                        {DType::f32, DType::f64}))->group(g);
  add_enum(app, "--spectral-method", c.spectral_method,
           "spectral: U V^T by quintic Newton-Schulz iterations or exactly (an eigendecomposition in f64)")->group(g);
  app.add_option("--newton-schulz-steps", c.newton_schulz_steps, "spectral: Newton-Schulz iterations")
      ->group(g)->check(cli::at_least(1));
  add_enum(app, "--spectral-scale", c.spectral_scale,
           "spectral, dion: a block [r, c] times none: 1, muon: max(1, r/c)^(1/2), rms: 0.2 sqrt(max(r, c)), fan: "
           "(r/c)^(1/2); auto: muon for spectral, fan (the reference's) for dion")->group(g);
  shapes_state(app.add_option("--dion-rank-fraction", c.dion_rank_fraction,
                              "dion: the rank of a matrix [m, n] is ceil(this min(m, n))"))
      ->group(g)->check(cli::between(0, 1));
  shapes_state(app.add_option("--dion-rank", c.dion_rank, "dion: this rank (at most min(m, n)) instead (0: the fraction)"))
      ->group(g)->check(cli::at_least(0));
  shapes_state(add_enum(app, "--dion-sync", c.dion_sync,
                        "dion: factors: each rank keeps its own buffer and only the factors P, R are all-reduced "
                        "((m + n) r values per matrix instead of m n; --clip and grad_norm then leave these matrices out); gradients: the matrices' gradients "
                        "all-reduced as the others'"))->group(g);
  app.add_option("--diagonal-params", c.diagonal_params,
                 "parameters whose name contains one of these take the grafting direction alone (no factors), e.g. "
                 "embeddings,output for Muon")->group(g)->delimiter(',')->type_name("NAME,...");
  app.add_option("--qr-max-iterations", c.qr_max_iterations, "qr: at most this many QR iterations per root step")
      ->group(g)->check(cli::at_least(0));
  app.add_option("--qr-tolerance", c.qr_tolerance,
                 "qr: no more iterations once the off-diagonal part of Q^T F Q is at most this fraction of it (Frobenius; "
                 "0: always --qr-max-iterations, as the reference)")
      ->group(g)->check(cli::between(0, 1));
  app.add_option("--root-spread", c.root_spread,
                 "recompute the roots in this many phases spread over each period, each root step doing about 1/S of "
                 "the blocks (1: all at once, the reference's schedule)")
      ->group(g)->check(cli::at_least(1));
  add_enum(app, "--grafting", c.grafting, "step-size grafting")->group(g);
  add_enum(app, "--grafting-scope", c.grafting_scope,
           "all: every block takes the grafting norm; diagonal: only the diagonal blocks (--diagonal-params, "
           "vectors), which take the grafting direction, the others going ungrafted (Muon with AdamW on the rest)")
      ->group(g);
  app.add_option("--grafting-beta2", c.grafting_beta2, "second-moment decay of rmsprop/adam grafting")
      ->group(g)->check(cli::between(0, 1));
  app.add_option("--grafting-epsilon", c.grafting_epsilon, "epsilon of the grafting method")
      ->group(g)->check(cli::positive());
  add_enum(app, "--weight-decay-type", c.weight_decay_type,
           "how --weight-decay enters: decoupled (wd W added to the search direction, before momentum) or l2 "
           "(added to the gradient, before preconditioning)")->group(g);
  app.add_flag_callback("--no-bias-correction", [&c] { c.use_bias_correction = false; },
                        "no bias correction of the filtered gradient and factors")->group(g);
  app.add_option("--trainers-per-group", c.trainers_per_group,
                 "split the ranks that share the blocks (the world; fsdp-train: the shard group) into groups of g "
                 "ranks that each compute every block (0: one group)")
      ->group(g)->check(cli::at_least(0));
  add_enum(app, "--direction-dtype", c.communication_dtype, "search directions all-gathered in this precision",
           {DType::f32, DType::bf16})->group(g);
}

compress::Config CompressorOptions::config(uint64_t seed) const {
  compress::Config c = compressor;
  c.warm_start = !no_warm_start;
  c.error_feedback = !no_error_feedback;
  c.seed = seed;
  c.validate();
  if (c.kind == compress::Kind::auto_ && rank != nullptr && rank->count() > 0)
    fail_usage("--compressor auto chooses the rank itself: give it --auto-ranks LOW,HIGH, not --rank");
  return c;
}

void add_compressor_options(CLI::App& app, CompressorOptions& o, const std::string& none_help) {
  compress::Config& c = o.compressor;
  const char* g = "Compression";
  using compress::Kind;
  const std::vector<Kind> kinds = {Kind::powersgd, Kind::none, Kind::topk, Kind::randomk, Kind::signum, Kind::auto_};
  shapes_state(add_enum(app, "--compressor", c.kind, "gradient aggregation (none: " + none_help + ")", kinds))->group(g);
  o.rank = shapes_state(app.add_option("--rank", c.rank, "PowerSGD rank r"))->group(g)->check(at_least(1));
  o.start_iter = app.add_option("--start-iter", c.start_iter, "plain all-reduce for the first K steps (with --sync diloco|streaming: K outer steps, 0 by default)")
                     ->group(g)->check(at_least(0));
  app.add_option("--min-compression-rate", c.min_compression_rate,
                 "compress a matrix only when it shrinks at least this much")->group(g)->check(positive());
  app.add_flag("--no-warm-start", o.no_warm_start, "draw a new Q every step instead of reusing the last")->group(g);
  shapes_state(app.add_flag("--no-error-feedback", o.no_error_feedback, "drop what the compression leaves out"))->group(g);
  shapes_state(add_enum(app, "--error-mode", c.error_mode,
                        "error feedback: projection (M - P(P^T M), bounded per rank) or full (M - P Q^T)"))->group(g);
  add_enum(app, "--orthogonalize", c.orthogonalize, "auto (Gram-Schmidt for rank <= 2, QR above), mgs or qr")->group(g);
  add_enum(app, "--comm-dtype", c.comm_dtype, "P and Q on the wire", {DType::f32, DType::bf16})->group(g);
  app.add_option("--compress-ratio", c.ratio, "topk/randomk: fraction of each gradient's coordinates sent")
      ->group(g)->check(positive())->check(at_most(1));
  const char* ga = "Compression: auto";
  shapes_state(app.add_option("--auto-ranks", c.auto_ranks,
                              "the PowerSGD ranks auto chooses between, LOW,HIGH: Accordion's low in regular regimes, "
                              "high in critical ones"))->group(ga)->delimiter(',')->expected(2)->check(at_least(1))->type_name("LOW,HIGH");
  app.add_option("--accordion-eta", c.accordion_eta,
                 "a bucket's regime is critical when its mean gradient norm changed by at least this fraction since "
                 "the last interval")->group(ga)->check(positive());
  app.add_option("--auto-interval", c.auto_interval, "auto decides every K steps from --start-iter on")
      ->group(ga)->check(at_least(1));
  app.add_option("--auto-refresh", c.auto_refresh, "auto measures the link again every K steps (0: once)")
      ->group(ga)->check(at_least(0));
}

parallel::OuterConfig SyncOptions::config() const {
  parallel::OuterConfig c = outer;
  if (every == "auto") {
    c.every = 0;
  } else {
    size_t used = 0;
    try {
      c.every = std::stoll(every, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != every.size() || c.every < 1)
      fail_usage("--sync-every {}: expected a number of steps (at least 1) or auto", every);
  }
  if (c.sync == parallel::Sync::every_step) {
    for (const CLI::Option* opt : outer_options)
      if (opt->count() > 0) fail_usage("{} needs --sync diloco or streaming", opt->get_name());
    return c;
  }
  if (c.sync == parallel::Sync::streaming) {
    if (fragments->count() == 0) c.fragments = c.every == 0 ? 0 : 4;  // auto: F chosen with H
    if (delay->count() == 0) c.delay = 1;
  }
  if (mix->count() == 0) c.mix = c.delay > 0 ? 0.5 : 0.0;
  return c;
}

void add_sync_options(CLI::App& app, SyncOptions& s, bool groups) {
  parallel::OuterConfig& c = s.outer;
  const char* g = "Synchronisation";
  shapes_state(add_enum(app, "--sync", c.sync,
                        "every-step (gradients aggregated every step), diloco (H inner steps per replica, then an outer "
                        "Nesterov step on the mean pseudo-gradient) or streaming (DiLoCo by fragments, overlapped)"))
      ->group(g);
  const auto outer = [&s](CLI::Option* o) {
    s.outer_options.push_back(o);
    return o->group("Synchronisation");
  };
  shapes_state(outer(app.add_option("--sync-every", s.every,
                                    "H: inner steps between a fragment's synchronisations, or auto (chosen from the "
                                    "link and the steps' time)")))
      ->type_name("H|auto");
  outer(app.add_option("--outer-lr", c.lr, "the outer step's learning rate"))->check(positive());
  outer(app.add_option("--outer-momentum", c.momentum, "the outer step's Nesterov momentum (0: none)"))
      ->check(at_least(0));
  s.fragments = shapes_state(outer(app.add_option("--fragments", c.fragments,
                                                  "streaming: F fragments of the model's parameters (balanced by "
                                                  "size), one synchronised every H / F steps (default 4; with "
                                                  "--sync-every auto chosen with H)")))
                    ->check(at_least(1));
  s.delay = shapes_state(outer(app.add_option("--sync-delay", c.delay,
                                              "tau: inner steps a fragment's exchange overlaps before it is applied "
                                              "(streaming: default 1)")))
                ->check(at_least(0));
  s.mix = outer(app.add_option("--outer-mix", c.mix,
                               "alpha: a fragment's local weights become alpha local + (1 - alpha) outer when it is "
                               "applied (default 0.5 with --sync-delay, else 0)"))
              ->check(at_least(0))->check(at_most(1));
  shapes_state(outer(add_enum(app, "--outer-dtype", c.wire,
                              "the pseudo-gradients on the wire: f32, bf16, int8 or e3m0 (4 bits; scales per 128 "
                              "elements), with error feedback")));
  if (groups)
    shapes_state(outer(app.add_option("--sync-groups", c.group,
                                    "ranks per replica (consecutive ranks): they all-reduce every step, and the "
                                    "replicas synchronise as --sync says")))
      ->check(at_least(1));
}

}  // namespace dtk::train
