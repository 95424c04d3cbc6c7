// Internal to optim: reading config fields from JSON with a UsageError that names the key.
#pragma once
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <type_traits>

#include "dtk/core/error.h"

namespace dtk::optim::detail {

// j[key] as T when present, else fallback; a wrong type is a UsageError naming the key.
template <typename T>
T field(const nlohmann::json& j, const char* key, T fallback, const char* what) {
  if (!j.contains(key)) return fallback;
  const auto& v = j.at(key);
  if constexpr (std::is_same_v<T, bool>) {
    if (!v.is_boolean()) fail_usage(std::string(what) + ": '" + key + "' must be true or false, got " + v.dump());
    return v.get<bool>();
  } else if constexpr (std::is_same_v<T, std::string>) {
    if (!v.is_string()) fail_usage(std::string(what) + ": '" + key + "' must be a string, got " + v.dump());
    return v.get<std::string>();
  } else if constexpr (std::is_integral_v<T>) {
    if (!v.is_number_integer()) fail_usage(std::string(what) + ": '" + key + "' must be an integer, got " + v.dump());
    return v.get<T>();
  } else {
    if (!v.is_number()) fail_usage(std::string(what) + ": '" + key + "' must be a number, got " + v.dump());
    return v.get<T>();
  }
}

// j is an object whose keys are all known.
inline void check_keys(const nlohmann::json& j, const std::set<std::string>& known, const char* what) {
  if (!j.is_object()) fail_usage(std::string(what) + ": expected a JSON object, got " + j.dump());
  for (const auto& [k, v] : j.items()) {
    if (known.count(k)) continue;
    std::string list;
    for (const auto& n : known) list += (list.empty() ? "" : ", ") + n;
    fail_usage(std::string(what) + ": unknown key '" + k + "' (known: " + list + ")");
  }
}

}  // namespace dtk::optim::detail
