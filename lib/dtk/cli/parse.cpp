#include "dtk/cli/parse.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <iterator>
#include <sstream>
#include <toml++/toml.h>

namespace dtk::cli {
namespace {

std::string at(const toml::source_region& r) { return fmt::format("line {}, column {}", r.begin.line, r.begin.column); }

std::string type_of(const toml::node& v) {
  std::ostringstream s;
  s << v.type();
  return s.str();
}

// A TOML scalar as the text CLI11 converts; empty optional: not a scalar an option can take.
std::optional<std::string> scalar_text(const toml::node& v) {
  if (const auto* s = v.as_string()) return s->get();
  if (const auto* i = v.as_integer()) return std::to_string(i->get());
  if (const auto* f = v.as_floating_point()) return fmt::format("{}", f->get());  // shortest round trip
  if (const auto* b = v.as_boolean()) return std::string(b->get() ? "true" : "false");
  return std::nullopt;
}

void read_table(const CLI::App* app, const toml::table& t, std::vector<std::string>& parents,
                std::vector<CLI::ConfigItem>& out, std::map<std::string, std::string>& where) {
  for (auto&& [key, value] : t) {
    const std::string name(key.str());
    std::string full;
    for (const auto& p : parents) full += p + ".";
    full += name;
    if (const auto* sub = value.as_table()) {  // a section: a subcommand's options
      const CLI::App* s = nullptr;
      if (app)
        for (const CLI::App* c : app->get_subcommands([](const CLI::App*) { return true; }))
          if (c->get_name() == name) s = c;
      if (!s)
        throw CLI::ConfigError(fmt::format("line {}: [{}]: no subcommand {} (a section holds a subcommand's options)",
                                           value.source().begin.line, full, name));
      parents.push_back(name);
      out.push_back({parents, "++", {}});
      read_table(s, *sub, parents, out, where);
      out.push_back({parents, "--", {}});
      parents.pop_back();
      continue;
    }
    CLI::ConfigItem item{parents, name, {}};
    std::ostringstream shown;
    if (const auto* a = value.as_array()) {
      for (const toml::node& e : *a) {
        const auto s = scalar_text(e);
        if (!s) throw CLI::ConfigError(fmt::format("{}: {} holds an element no option can take (a {})", at(e.source()),
                                                   full, type_of(e)));
        item.inputs.push_back(*s);
      }
      shown << *a;
    } else if (const auto s = scalar_text(value)) {
      item.inputs.push_back(*s);
      value.visit([&](const auto& v) { shown << v; });
    } else {
      throw CLI::ConfigError(fmt::format("{}: {} is a {}, which no option takes", at(value.source()), full,
                                         type_of(value)));
    }
    where[full] = fmt::format("line {}: {} = {}", value.source().begin.line, full, shown.str());
    out.push_back(std::move(item));
  }
}

// Edits between a and b: insertions, deletions, substitutions and swaps of neighbours (setps is
// one edit from steps).
size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<std::vector<size_t>> d(a.size() + 1, std::vector<size_t>(b.size() + 1));
  for (size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (size_t i = 1; i <= a.size(); ++i)
    for (size_t j = 1; j <= b.size(); ++j) {
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  return d[a.size()][b.size()];
}

// The closest of `names` to `name`: within a third of its length (at least 1, at most 3
// edits), or the only name it begins.
std::string closest(const std::vector<std::string>& names, const std::string& name) {
  std::string best;
  size_t best_d = std::clamp<size_t>(name.size() / 3, 1, 3) + 1;
  std::vector<std::string> prefixed;
  for (const auto& n : names) {
    if (const size_t d = edit_distance(name, n); d < best_d) best_d = d, best = n;
    if (!name.empty() && n.rfind(name, 0) == 0) prefixed.push_back(n);
  }
  if (best.empty() && prefixed.size() == 1) best = prefixed[0];
  return best;
}

void long_names(const CLI::App& app, std::vector<std::string>& out) {
  for (const CLI::Option* o : app.get_options())
    for (const auto& n : o->get_lnames()) out.push_back(n);
  for (const CLI::App* s : app.get_subcommands([](const CLI::App*) { return true; })) long_names(*s, out);
}

// The option `arg` ("--steps") of the app or of one of its subcommands; null when none has it.
const CLI::Option* find_option(const CLI::App& app, const std::string& arg) {
  if (const CLI::Option* o = app.get_option_no_throw(arg)) return o;
  for (const CLI::App* s : app.get_subcommands([](const CLI::App*) { return true; }))
    if (const CLI::Option* o = find_option(*s, arg)) return o;
  return nullptr;
}

bool known_option(const CLI::App& app, const std::string& arg) { return find_option(app, arg) != nullptr; }

// The first "--name" in a CLI11 message that names an option of the app.
std::string option_in(const CLI::App& app, const std::string& m) {
  for (size_t k = m.find("--"); k != std::string::npos; k = m.find("--", k + 2)) {
    size_t e = k + 2;
    while (e < m.size() && (std::isalnum(static_cast<unsigned char>(m[e])) || m[e] == '-' || m[e] == '_')) ++e;
    const std::string opt = m.substr(k, e - k);
    if (opt.size() > 2 && known_option(app, opt)) return opt;
  }
  return {};
}

bool given_on_command_line(const std::vector<std::string>& args, const std::string& opt) {
  return std::any_of(args.begin(), args.end(),
                     [&](const std::string& a) { return a == opt || a.rfind(opt + "=", 0) == 0; });
}

}  // namespace

std::shared_ptr<TomlConfig> use_toml_config(CLI::App& app) {
  app.set_config("--config", "", "read options from a TOML file: one long option per line without its dashes, "
                 "`steps = 300`; options on the command line win (*.ini: CLI11's INI format)");
  auto config = std::make_shared<TomlConfig>(&app);
  app.config_formatter(config);
  app.allow_config_extras(CLI::config_extras_mode::error);  // a key that no option takes is a mistake
  app.option_defaults()->always_capture_default();
  // A repeated option takes its last value, as in most Unix tools (a script can override a default).
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  return config;
}

void parse_args(CLI::App& app, int argc, char** argv) {
  const std::vector<std::string> args(argv + 1, argv + argc);
  // CLI11 picks its reader before it reads: a *.ini file gets its INI reader.
  for (size_t i = 0; i < args.size(); ++i)
    if ((args[i] == "--config" && i + 1 < args.size() && args[i + 1].ends_with(".ini")) ||
        (args[i].starts_with("--config=") && args[i].ends_with(".ini")))
      app.config_formatter(std::make_shared<CLI::ConfigINI>());
  app.parse(argc, argv);
  // CLI11 lets a config file's array give fewer values than an option takes (input-shape = [1, 2]).
  for (const CLI::Option* o : app.get_options())
    if (const int n = o->get_expected_min(); n > 1 && o->count() > 0 && o->results().size() % static_cast<size_t>(n))
      throw CLI::ArgumentMismatch(o->get_name(), n, o->results().size());
}

std::string TomlConfig::to_config(const CLI::App* app, bool default_also, bool write_description,
                                  std::string prefix) const {
  return CLI::ConfigTOML().to_config(app, default_also, write_description, std::move(prefix));
}

std::vector<CLI::ConfigItem> TomlConfig::from_config(std::istream& input) const {
  where_.clear();
  const std::string text{std::istreambuf_iterator<char>(input), std::istreambuf_iterator<char>()};
  toml::table t;
  try {
    t = toml::parse(text);
  } catch (const toml::parse_error& e) {
    std::string what(e.description());
    if (what.find("could not determine value type") != std::string::npos)
      what += " (text needs quotes: model = \"llama-tiny\")";
    throw CLI::ConfigError(fmt::format("{}: not TOML: {}", at(e.source()), what));
  }
  std::vector<CLI::ConfigItem> items;
  std::vector<std::string> parents;
  read_table(app_, t, parents, items, where_);
  return items;
}

std::string TomlConfig::where(const std::string& key) const {
  const auto it = where_.find(key);
  return it == where_.end() ? std::string() : it->second;
}

std::string closest_option(const CLI::App& app, const std::string& name) {
  std::vector<std::string> names;
  long_names(app, names);
  return closest(names, name);
}

namespace {

// The line of a ParseError, before one_line.
std::pair<std::string, bool> error_line(const CLI::App& app, const CLI::ParseError& e, const std::vector<std::string>& args,
                                        const TomlConfig* config);

// Control characters (a TOML key or value may hold "\n") as escapes: the error stays one line.
std::string one_line(const std::string& s) {
  std::string out;
  for (const char c : s) {
    const auto u = static_cast<unsigned char>(c);
    if (c == '\n') out += "\\n";
    else if (c == '\r') out += "\\r";
    else if (c == '\t') out += "\\t";
    else if (u < 0x20 || u == 0x7f) out += fmt::format("\\x{:02x}", u);
    else out += c;
  }
  return out;
}

}  // namespace

std::pair<std::string, bool> parse_error_line(const CLI::App& app, const CLI::ParseError& e,
                                              const std::vector<std::string>& args, const TomlConfig* config) {
  auto [line, help] = error_line(app, e, args, config);
  return {one_line(line), help};
}

namespace {

std::pair<std::string, bool> error_line(const CLI::App& app, const CLI::ParseError& e, const std::vector<std::string>& args,
                                        const TomlConfig* config) {
  std::string m = e.what();
  // A value that broke a rule of checks.h: "--steps: must be at least 1" as a sentence.
  const bool rule = dynamic_cast<const CLI::ValidationError*>(&e) != nullptr;
  if (rule)
    if (const size_t k = m.find(": must "); k != std::string::npos) m.erase(k, 1);

  // A value that is not of the option's type: CLI11's "Could not convert: --steps = 1.5".
  if (dynamic_cast<const CLI::ConversionError*>(&e))
    if (const std::string opt = option_in(app, m); !opt.empty()) {
      const std::string type = find_option(app, opt)->get_type_name();
      const std::string value = m.substr(m.find(" = ") == std::string::npos ? m.size() : m.find(" = ") + 3);
      m = opt + " must be " + (type.rfind("INT", 0) == 0 || type.rfind("UINT", 0) == 0 ? "a whole number"
                               : type.rfind("FLOAT", 0) == 0                            ? "a number"
                                                                                        : "a " + type) +
          (value.empty() ? "" : ", not " + value);
    }
  const CLI::Option* config_opt = app.get_config_ptr();
  const bool from_file = config_opt && config_opt->count() > 0;
  const std::string file = from_file ? "--config " + config_opt->results().back() : "";
  if (from_file && dynamic_cast<const CLI::FileError*>(&e)) return {file + ": no such file, or it cannot be read", false};
  if (from_file && dynamic_cast<const CLI::ConfigError*>(&e)) {
    const std::string extra = "INI was not able to parse ";  // CLI::ConfigError::Extras: a key no option takes
    if (m.rfind(extra, 0) == 0) {
      const std::string key = m.substr(extra.size());
      const std::string near = closest_option(app, key.substr(key.rfind('.') + 1));
      const std::string line = config ? config->where(key) : "";
      return {fmt::format("{}{}{}: no option --{}{}", file, line.empty() ? "" : ", ", line, key,
                          near.empty() ? "" : "; did you mean " + near + "?"),
              false};
    }
    return {file + (m.rfind("line ", 0) == 0 ? ", " : ": ") + m, false};
  }
  // A value from the file that an option refused: the file, its line and the key first.
  if (from_file && config)
    if (const std::string opt = option_in(app, m); !opt.empty() && !given_on_command_line(args, opt))
      if (const std::string line = config->where(opt.substr(2)); !line.empty())
        return {fmt::format("{}, {}: {}", file, line, m), false};
  if (rule || dynamic_cast<const CLI::ConversionError*>(&e)) return {m, false};

  if (dynamic_cast<const CLI::ExtrasError*>(&e)) {
    for (const std::string& a : args) {
      if (a.size() < 2 || a[0] != '-' || std::isdigit(static_cast<unsigned char>(a[1])) || a[1] == '.') continue;
      const std::string opt = a.substr(0, a.find('='));
      if (known_option(app, opt)) continue;
      const std::string near = closest_option(app, opt.substr(opt.find_first_not_of('-')));
      return {"unknown option " + opt + (near.empty() ? "" : "; did you mean --" + near + "?"), true};
    }
  }
  // A subcommand the program does not have (CLI11: "A subcommand is required").
  const auto subs = app.get_subcommands([](const CLI::App*) { return true; });
  if (!subs.empty() && dynamic_cast<const CLI::RequiredError*>(&e) && m.find("subcommand") != std::string::npos) {
    std::vector<std::string> names;
    for (const CLI::App* s : subs) names.push_back(s->get_name());
    std::string list;
    for (size_t i = 0; i < names.size(); ++i) list += (i == 0 ? "" : i + 1 == names.size() ? " or " : ", ") + names[i];
    const auto first = std::find_if(args.begin(), args.end(), [](const std::string& a) { return a.empty() || a[0] != '-'; });
    if (first == args.end()) return {"a subcommand is needed: " + list, true};
    const std::string near = closest(names, *first);
    return {"unknown subcommand '" + *first + "'" + (near.empty() ? "" : "; did you mean " + near + "?") +
                " The subcommands: " + list,
            true};
  }
  return {m, true};
}

}  // namespace

}  // namespace dtk::cli
