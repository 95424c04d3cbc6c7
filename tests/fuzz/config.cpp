// Fuzz target: a --config file (TOML, read by cli::TomlConfig through CLI11, as cli::main reads
// it: use_toml_config, parse_args, and parse_error_line for the one line a bad file gets) for an
// app with the kinds of options dtk's programs take: whole numbers with a rule, numbers, choices,
// text, flags, lists of a fixed and of any length, and a subcommand whose section holds its own.
// Seeds: share/dtk/configs/*.toml and tests' configs (corpus/config/).
#include <string>
#include <vector>

#include "dtk/cli/checks.h"
#include "dtk/cli/parse.h"
#include "fuzz.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto path = dtk::fuzz::scratch() / "run.toml";
  dtk::fuzz::write_file(path, data, size);
  dtk::fuzz::expect_usage_errors([&] {
    CLI::App app{"fuzz", "fuzz"};
    const auto config = dtk::cli::use_toml_config(app);
    int64_t steps = 10, micro = 0;
    double lr = 0.1;
    std::string model = "llama-tiny", data = "synthetic";
    bool flag = false;
    std::vector<int64_t> shape;
    std::vector<std::string> names;
    app.add_option("--steps", steps)->check(dtk::cli::positive());
    app.add_option("--micro-batch", micro)->check(dtk::cli::at_least(0));
    app.add_option("--lr", lr)->check(dtk::cli::positive());
    app.add_option("--model", model)->check(CLI::IsMember({"llama-tiny", "llama-small", "mlp", "resnet-8"}));
    app.add_option("--data", data);
    app.add_flag("--checkpoint-activations", flag);
    app.add_option("--input-shape", shape)->expected(3);
    app.add_option("--tensors", names);
    CLI::App* sub = app.add_subcommand("export", "a subcommand");
    std::string format = "npz";
    sub->add_option("--format", format)->check(CLI::IsMember({"safetensors", "npz"}));
    sub->add_option("--steps", steps);
    const std::string arg0 = "fuzz", arg1 = "--config", arg2 = path.string();
    char* argv[] = {const_cast<char*>(arg0.c_str()), const_cast<char*>(arg1.c_str()), const_cast<char*>(arg2.c_str())};
    try {
      dtk::cli::parse_args(app, 3, argv);
    } catch (const CLI::ParseError& e) {
      const auto [line, help] = dtk::cli::parse_error_line(app, e, {arg1, arg2}, config.get());
      if (line.empty() || line.find('\n') != std::string::npos) {
        std::fprintf(stderr, "fuzz: the error is not one line: [%s]\n", line.c_str());
        std::abort();
      }
    }
  });
  return 0;
}
