// The command line of the *-train programs: the options every one of them shares, Shampoo's, and
// the --help footer's list of metrics. They fill dtk::train::Options; the loop knows nothing of CLI11.
#pragma once
#include <CLI/CLI.hpp>
#include <string>

#include "dtk/optim/shampoo.h"
#include "dtk/train/metrics.h"
#include "dtk/train/options.h"

namespace dtk::train {

// The --help footer's line of metrics (train/metrics.h's schema): the loop's own and those of
// `added`, the program's placement or compressor.
std::string metrics_help(MetricSource added);

// Registers the common options in groups "Model", "Data", "Optimization", "Run".
void add_options(CLI::App& app, Options& o);
// Registers Shampoo's options (group "Shampoo") into c (train::strategy applies the common options
// on top), those that split its work over ranks (--trainers-per-group, --direction-dtype) included.
void add_shampoo_options(CLI::App& app, optim::ShampooConfig& c);

}  // namespace dtk::train
