// The numeric rules of every program's options, as CLI11 validators (->check(cli::at_least(1))).
// CLI11 reports a failed check as CLI::ValidationError "NAME: MESSAGE"; these rules' messages
// start with "must", and cli::main joins the two into one sentence that names the option and
// states the rule:
//   psgd-train: error: --steps must be at least 1
// A value that is not a finite number fails every rule ("--lr must be a finite number").
//
// Enum options take the names of the enum's table (core/enums.h) and show them in --help
// ("TEXT:{f32,bf16}=f32"); a name outside them is "--comm-dtype must be one of f32 or bf16".
#pragma once
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdint>
#include <string_view>
#include <string>
#include <vector>

#include "dtk/core/enums.h"

namespace dtk::cli {

CLI::Validator at_least(double min);            // "must be at least MIN"
CLI::Validator at_most(double max);             // "must be at most MAX"
CLI::Validator positive();                      // "must be positive" (> 0)
CLI::Validator between(double lo, double hi);   // "must be between LO and HI" (both included)

// Sizes with binary suffixes: 8, 64K, 64KiB, 1.5M, 2G (K = 1024). UsageError on anything else.
// One size type for every option that takes bytes (add_size).
uint64_t parse_size(std::string_view s);
std::string format_size(uint64_t bytes);  // 64K, 1M, 3.5M, 17

// Option `name` setting `target` (bytes) from a size ("must be a size ..." otherwise); its
// current value is the default.
template <class T>
CLI::Option* add_size(CLI::App& app, const std::string& name, T& target, const std::string& help) {
  return app
      .add_option_function<std::string>(
          name, [&target](const std::string& s) { target = static_cast<T>(parse_size(s)); }, help)
      ->check(CLI::Validator(
          [](std::string& s) -> std::string {
            try {
              parse_size(s);
              return {};
            } catch (const std::exception&) {
              return "must be a size: bytes with an optional K, M, G or T (powers of 1024), as 25M";
            }
          },
          ""))
      ->type_name("SIZE")
      ->default_str(format_size(static_cast<uint64_t>(target)));
}

// "must be one of a, b or c" unless the value names one of `values`.
template <NamedEnum E>
CLI::Validator one_of(const std::vector<E>& values = enum_values<E>()) {
  std::string names;
  for (E e : values) names += (names.empty() ? "" : ",") + std::string(name_of(e));
  return CLI::Validator(
      [values](std::string& s) -> std::string {
        E e{};
        if (try_parse_enum(s, e) && std::find(values.begin(), values.end(), e) != values.end()) return {};
        return "must be one of " + choices_of(values);
      },
      "{" + names + "}");
}

// Option `name` setting `target` to one of `values` by name; its current value is the default.
template <NamedEnum E>
CLI::Option* add_enum(CLI::App& app, const std::string& name, E& target, const std::string& help,
                      const std::vector<E>& values = enum_values<E>()) {
  return app
      .add_option_function<std::string>(
          name, [&target](const std::string& s) { target = parse_enum<E>(s, "value"); }, help)
      ->check(one_of(values))
      ->type_name("TEXT")
      ->default_str(std::string(name_of(target)));
}

}  // namespace dtk::cli
