// How a program's command line and --config file become options, and the one line that says
// what was wrong when they do not (cli::main uses both; tests/unit/test_cli.cpp tests them).
//
// --config FILE is TOML, read strictly by toml++: a file that does not parse is an error naming
// its line and column (CLI11's own reader took `steps = [1,` as steps = 1). A key is a long
// option without its dashes; a value is a string, number, boolean (a flag) or an array (an
// option that takes several). A file named *.ini is read by CLI11's INI reader instead.
#pragma once
#include <CLI/CLI.hpp>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace dtk::cli {

class TomlConfig : public CLI::Config {
 public:
  explicit TomlConfig(const CLI::App* app = nullptr) : app_(app) {}  // the app whose subcommands sections name
  std::string to_config(const CLI::App* app, bool default_also, bool write_description,
                        std::string prefix) const override;
  // CLI::ConfigError "line L, column C: WHAT" when the text is not TOML or holds what no option
  // can take (a date, an array of tables, a section that names no subcommand).
  std::vector<CLI::ConfigItem> from_config(std::istream& input) const override;
  // Where the last file read set `key` (a long option's name, sections joined by '.'):
  // "line 3: steps = "abc"", or empty when it did not.
  std::string where(const std::string& key) const;

 private:
  const CLI::App* app_;
  mutable std::map<std::string, std::string> where_;
};

// Sets up `app` as every dtk program's: --config FILE read by a TomlConfig (returned), a key no
// option takes an error, defaults captured, a repeated option taking its last value. Options
// added later inherit the defaults. (cli::main; tests/fuzz/config.cpp.)
std::shared_ptr<TomlConfig> use_toml_config(CLI::App& app);

// app.parse(argc, argv) as every dtk program parses (cli::main): a --config FILE named *.ini is
// read by CLI11's INI reader, and an array in the file with fewer values than its option takes
// is a CLI::ArgumentMismatch. Throws CLI::ParseError (parse_error_line says it in one line).
void parse_args(CLI::App& app, int argc, char** argv);

// The line that says what went wrong in app.parse(args), and whether "--help" would tell more
// (one line: control characters from the file, a key "a\nb", are shown as escapes):
//  - a value that broke a rule: CLI11's "--steps: must be at least 1" as "--steps must be at
//    least 1"; when the value came from the --config file, the file, the line and the key first;
//  - a --config file that is missing, is not TOML, or sets a key no option takes (with the
//    closest option's name);
//  - an unknown option, with the closest known one ("unknown option --step; did you mean
//    --steps?"), and an unknown subcommand with the list of them.
// `args` are the command-line arguments without the program's name; `config` the app's reader.
std::pair<std::string, bool> parse_error_line(const CLI::App& app, const CLI::ParseError& e,
                                              const std::vector<std::string>& args, const TomlConfig* config);

// The long option of `app` (or of its subcommands) closest to `name` (without dashes) by edit
// distance, when it is close enough to be a likely typo; else empty.
std::string closest_option(const CLI::App& app, const std::string& name);

}  // namespace dtk::cli
