// shard-inspect: inspect, verify, diff, consolidate, reshard, convert and export dtk checkpoints
// (see man shard-inspect). One subcommand per job, git-style.
#include <memory>
#include <utility>
#include <vector>

#include "command.h"
#include "dtk/cli/cli.h"
#include "dtk/core/error.h"

namespace dtk::inspect {

const std::vector<CommandSpec>& commands() {
  static const std::vector<CommandSpec> specs = {
      {"ls", "list tensors: name, dtype, shape, sharding, bytes", make_ls},
      {"show", "show the metadata of a checkpoint", make_show},
      {"stats", "per-tensor L2 norm, min, max, mean, std, NaN and Inf counts", make_stats},
      {"diff", "compare two checkpoints tensor by tensor (exit 0 same, 1 different)", make_diff},
      {"verify", "read every tensor (checksums) and check every shard file", make_verify},
      {"consolidate", "write a sharded state as one full checkpoint", make_consolidate},
      {"reshard", "write a checkpoint as a sharded state of M ranks", make_reshard},
      {"convert", "convert float tensors to bf16, f16 or f32", make_convert},
      {"extract", "write a full checkpoint with only the named tensors", make_extract},
      {"export", "export every tensor, or the named ones (model/), to safetensors or npz", make_export},
  };
  return specs;
}

}  // namespace dtk::inspect

namespace {
using namespace dtk;

// The subcommands, each with its options.
using Commands = std::vector<std::pair<CLI::App*, std::unique_ptr<inspect::Command>>>;

cli::Program program(Commands& subs) {
  cli::Program p;
  p.name = "shard-inspect";
  p.description =
      "Inspect, verify, diff, consolidate, reshard, convert and export dtk checkpoints (full HDF5 files and "
      "sharded states).";
  p.footer =
      "CKPT is a full checkpoint file, a sharded state's directory or its index.h5.\n"
      "Exit status: 0 success (diff: same), 1 diff found differences or a failure while running, 2 bad usage or "
      "bad input.\n"
      "Example: shard-inspect reshard ckpt/step-00001000 --world-size 8 -o resharded";
  p.add_options = [&subs](CLI::App& app) {
    app.require_subcommand(1, 1);
    app.fallthrough();
    for (const auto& spec : inspect::commands()) {
      CLI::App* sub = app.add_subcommand(spec.name, spec.summary);
      auto cmd = spec.make();
      cmd->add_options(*sub);
      subs.emplace_back(sub, std::move(cmd));
    }
  };
  p.validate = [&subs](comm::Runtime& rt) -> cli::Work {
    if (rt.size() > 1)
      fail_usage("shard-inspect runs as one process, but this job has {} ranks", rt.size());
    inspect::Command* chosen = nullptr;
    for (auto& [sub, cmd] : subs)
      if (sub->parsed()) chosen = cmd.get();
    chosen->validate();
    return [chosen](comm::Runtime&) { return chosen->run(); };
  };
  return p;
}

}  // namespace

int main(int argc, char** argv) {
  Commands subs;
  return dtk::cli::main(argc, argv, program(subs));
}
