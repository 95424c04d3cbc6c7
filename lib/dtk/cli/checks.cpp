#include "dtk/cli/checks.h"

#include <cmath>
#include <cstdio>
#include <functional>

namespace dtk::cli {
namespace {
// A bound as the user would write it: 1, 0.5, 1e-09, 2147483648.
std::string number(double v) {
  char buf[40];
  if (v == std::floor(v) && std::fabs(v) < 1e18)
    std::snprintf(buf, sizeof buf, "%lld", static_cast<long long>(v));
  else
    std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

// A validator of numbers: `ok` says whether a finite value keeps the rule; `rule` completes
// "must ..." (cli::main puts the option's name in front).
CLI::Validator rule(const std::string& help, const std::string& rule, std::function<bool(double)> ok) {
  return CLI::Validator(
      [rule, ok](std::string& s) -> std::string {
        double v = 0;
        if (s.empty() || !CLI::detail::lexical_cast(s, v) || !std::isfinite(v)) return "must be a finite number";
        return ok(v) ? std::string() : "must " + rule;
      },
      help);
}

}  // namespace

CLI::Validator at_least(double min) {
  return rule(">= " + number(min), "be at least " + number(min), [min](double v) { return v >= min; });
}
CLI::Validator at_most(double max) {
  return rule("<= " + number(max), "be at most " + number(max), [max](double v) { return v <= max; });
}
CLI::Validator positive() {
  return rule("> 0", "be positive", [](double v) { return v > 0; });
}
CLI::Validator between(double lo, double hi) {
  return rule("in [" + number(lo) + ", " + number(hi) + "]", "be between " + number(lo) + " and " + number(hi),
              [lo, hi](double v) { return v >= lo && v <= hi; });
}

}  // namespace dtk::cli
