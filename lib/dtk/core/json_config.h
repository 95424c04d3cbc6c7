// Configs to and from JSON. A config struct declares its fields once, beside the struct:
//
//   NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE_WITH_DEFAULT(Config, kind, rank, ...)
//
// which writes every field and reads them, a missing key keeping its default (enums as their
// names: core/enums.h). read_config adds the checks that a file from a user needs, in one
// place: an object, only known keys (those a default config writes), and each value of the
// type its default has (an integer stays an integer, no negative into an unsigned field, an
// enum one of its names): a UsageError naming the config and the key; then T::validate(), when
// T has one.
#pragma once
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "dtk/core/error.h"

namespace dtk {

namespace detail {
// What a value must be, in words, when it must be like `like`; empty when `v` is like it.
inline std::string json_kind_mismatch(const nlohmann::json& like, const nlohmann::json& v) {
  if (like.is_boolean()) return v.is_boolean() ? "" : "true or false";
  if (like.is_number_unsigned()) return v.is_number_unsigned() ? "" : "an integer >= 0";
  if (like.is_number_integer()) return v.is_number_integer() ? "" : "an integer";
  if (like.is_number()) return v.is_number() ? "" : "a number";
  if (like.is_string()) return v.is_string() ? "" : "a string";
  if (like.is_array()) return v.is_array() ? "" : "an array";  // its elements: the round trip below
  return "";
}
}  // namespace detail

// j as a T, checked (see above); `what` names the config in errors ("compressor config").
template <class T>
T read_config(const nlohmann::json& j, std::string_view what) {
  const std::string w(what);
  if (!j.is_object()) fail_usage(w + ": expected a JSON object, got " + j.dump());
  const nlohmann::json defaults = T{};
  for (const auto& [key, value] : j.items()) {
    if (!defaults.contains(key)) {
      std::string known;
      for (const auto& [k, v] : defaults.items()) known += (known.empty() ? "" : ", ") + k;
      fail_usage(w + ": unknown key '" + key + "' (known: " + known + ")");
    }
    if (const std::string need = detail::json_kind_mismatch(defaults.at(key), value); !need.empty())
      fail_usage(w + ": '" + key + "' must be " + need + ", got " + value.dump());
    // Converted and written back, the value must come out as it went in (no 1.5 into an
    // integer array, no unknown enum name).
    nlohmann::json probe = defaults;
    probe[key] = value;
    bool same = false;
    try {
      same = nlohmann::json(probe.get<T>()).at(key) == value;
    } catch (const nlohmann::json::exception&) {
    } catch (const UsageError& e) {
      fail_usage(w + ": '" + key + "': " + e.what());
    }
    if (!same) fail_usage(w + ": '" + key + "' cannot be " + value.dump());
  }
  T c = j.get<T>();
  if constexpr (requires { c.validate(); }) c.validate();
  return c;
}

}  // namespace dtk
