// The command line of the *-train programs: the options every one of them shares, Shampoo's, and
// the --help footer's list of metrics. They fill dtk::train::Options; the loop knows nothing of CLI11.
#pragma once
#include <initializer_list>
#include <CLI/CLI.hpp>
#include <string>

#include "dtk/compress/compressor.h"
#include "dtk/optim/shampoo.h"
#include "dtk/parallel/diloco.h"
#include "dtk/train/metrics.h"
#include "dtk/train/options.h"

namespace dtk::train {

// The --help footer's line of metrics (train/metrics.h's schema): the loop's own and those of
// the sources `added`, the program's placement and compressor.
std::string metrics_help(std::initializer_list<MetricSource> added);

// Registers the common options in groups "Model", "Data", "Optimization", "Run".
void add_options(CLI::App& app, Options& o);
// Registers Shampoo's options (group "Shampoo") into c (train::strategy applies the common options
// on top), those that split its work over ranks (--trainers-per-group, --direction-dtype) included.
void add_shampoo_options(CLI::App& app, optim::ShampooConfig& c);

// The gradient compressor's options (group "Compression": --compressor, --rank, --start-iter, ...),
// psgd-train's and fsdp-train's; config() resolves them with the run's seed (and validates:
// --compressor auto with --rank is bad input).
struct CompressorOptions {
  compress::Config compressor;
  bool no_warm_start = false, no_error_feedback = false;
  CLI::Option* rank = nullptr;  // --rank, to tell a given one from the default
  CLI::Option* start_iter = nullptr;  // --start-iter (under --sync diloco it counts outer steps, from 0 by default)
  compress::Config config(uint64_t seed) const;
};
// `none_help`: what --compressor none means in the program. Every kind, auto's options in group
// "Compression: auto" (psgd-train per bucket of replicated parameters, fsdp-train per bucket of
// its plan on HSDP's replica hop).
void add_compressor_options(CLI::App& app, CompressorOptions& c, const std::string& none_help);

// psgd-train's and fsdp-train's synchronisation (group "Synchronisation": --sync, --sync-every,
// --outer-lr, ...): config() resolves --outer-mix's default (0.5 with --sync-delay, else 0) and
// refuses the outer options without --sync diloco|streaming; OuterConfig::validate checks the rest
// against the world. --sync-groups only where groups says (psgd-train: fsdp-train's replicas are
// its --replicate groups).
struct SyncOptions {
  parallel::OuterConfig outer;
  std::string every = "64";  // --sync-every: H or auto
  std::vector<CLI::Option*> outer_options;  // every option but --sync
  CLI::Option* mix = nullptr;
  CLI::Option* fragments = nullptr;
  CLI::Option* delay = nullptr;
  parallel::OuterConfig config() const;
};
void add_sync_options(CLI::App& app, SyncOptions& s, bool groups);

}  // namespace dtk::train
