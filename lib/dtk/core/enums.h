// Option values as enums, each with its names in one table beside the enum:
//
//   enum class Grafting { none, sgd, adagrad, rmsprop, adam };
//   DTK_ENUM_NAMES(Grafting, {Grafting::none, "none"}, {Grafting::sgd, "sgd"}, ...)
//
// The table prints (name_of), parses (parse_enum: a UsageError listing the choices), lists the
// choices for help and errors (choices_of), converts to and from JSON (to_json / from_json,
// found by nlohmann through ADL), and makes the command line's validator (cli::one_of in
// cli/checks.h). DTK_ENUM_NAMES goes in the enum's own namespace.
#pragma once
#include <array>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "dtk/core/dtype.h"
#include "dtk/core/error.h"

namespace dtk {

// An enum with a DTK_ENUM_NAMES table.
template <class E>
concept NamedEnum = std::is_enum_v<E> && requires(E e) { enum_names(e); };

// The table: (value, name) pairs in the order the help lists them.
template <NamedEnum E>
constexpr auto enum_table() {
  return enum_names(E{});
}

template <NamedEnum E>
std::vector<E> enum_values() {
  std::vector<E> v;
  for (const auto& [e, n] : enum_table<E>()) v.push_back(e);
  return v;
}

template <NamedEnum E>
std::string_view name_of(E e) {
  for (const auto& [v, n] : enum_table<E>())
    if (v == e) return n;
  throw Error(fmt::format("enum value {} has no name", static_cast<long long>(e)));
}

// "a, b or c"
template <NamedEnum E>
std::string choices_of(const std::vector<E>& values = enum_values<E>()) {
  std::string s;
  for (size_t i = 0; i < values.size(); ++i)
    s += (i == 0 ? "" : i + 1 == values.size() ? " or " : ", ") + std::string(name_of(values[i]));
  return s;
}

// Whether `s` names a value; if so, `out` is it.
template <NamedEnum E>
bool try_parse_enum(std::string_view s, E& out) {
  for (const auto& [v, n] : enum_table<E>())
    if (n == s) {
      out = v;
      return true;
    }
  return false;
}

// The value named `s`; a UsageError "WHAT: 's' is not one of a, b or c" otherwise.
template <NamedEnum E>
E parse_enum(std::string_view s, std::string_view what) {
  E e{};
  if (!try_parse_enum(s, e))
    fail_usage(std::string(what) + ": '" + std::string(s) + "' is not one of " + choices_of<E>());
  return e;
}

}  // namespace dtk

// The names of enum E, and its JSON conversion (a string; an unknown name is a UsageError).
#define DTK_ENUM_NAMES(E, ...)                                                                        \
  [[maybe_unused]] constexpr auto enum_names(E) {                                                     \
    return std::to_array<std::pair<E, std::string_view>>({__VA_ARGS__});                             \
  }                                                                                                   \
  [[maybe_unused]] inline void to_json(nlohmann::json& j, E e) { j = std::string(::dtk::name_of(e)); } \
  [[maybe_unused]] inline void from_json(const nlohmann::json& j, E& e) {                             \
    if (!j.is_string()) ::dtk::fail_usage("expected one of " + ::dtk::choices_of<E>() + ", got " + j.dump()); \
    e = ::dtk::parse_enum<E>(j.get<std::string>(), "value");                                          \
  }

namespace dtk {
// The element types by their names (dtype_name; parse_dtype also takes aliases such as "float").
DTK_ENUM_NAMES(DType, {DType::f32, "f32"}, {DType::f64, "f64"}, {DType::bf16, "bf16"}, {DType::f16, "f16"},
               {DType::i32, "i32"}, {DType::i64, "i64"}, {DType::u8, "u8"}, {DType::u16, "u16"})
}  // namespace dtk
