// A checkpoint directory with retention (checkpoint.h: Directory).
#include <algorithm>
#include <charconv>
#include <fstream>

#include "dtk/ckpt/checkpoint.h"
#include "dtk/core/error.h"

namespace dtk::ckpt {
namespace fs = std::filesystem;

Directory::Directory(fs::path dir, int keep) : dir_(std::move(dir)), keep_(keep) {
  if (keep_ < 1) fail_usage("--keep must be at least 1");
}

fs::path Directory::entry(int64_t step, bool sharded) const {
  char buf[40];
  std::snprintf(buf, sizeof buf, "step-%08lld%s", static_cast<long long>(step), sharded ? "" : ".h5");
  return dir_ / buf;
}

namespace {
// step-NNNNNNNN or step-NNNNNNNN.h5 -> NNNNNNNN, or -1 (also for a number beyond int64: no
// entry of ours)
int64_t step_of(const fs::path& p) {
  std::string n = p.filename().string();
  if (n.size() > 3 && n.ends_with(".h5")) n.resize(n.size() - 3);
  if (!n.starts_with("step-") || n.size() == 5) return -1;
  for (size_t i = 5; i < n.size(); ++i)
    if (n[i] < '0' || n[i] > '9') return -1;
  int64_t step = -1;
  const auto [end, ec] = std::from_chars(n.data() + 5, n.data() + n.size(), step);
  return ec == std::errc() && end == n.data() + n.size() ? step : -1;
}
}  // namespace

void Directory::finish(const fs::path& entry) {
  write_file_atomic(dir_ / "latest", entry.filename().string() + "\n");  // also removes dead writers' temporaries
  std::vector<std::pair<int64_t, fs::path>> entries;
  for (const auto& e : fs::directory_iterator(dir_)) {
    const int64_t s = step_of(e.path());
    if (s >= 0) entries.emplace_back(s, e.path());
  }
  std::sort(entries.begin(), entries.end());
  const int64_t drop = static_cast<int64_t>(entries.size()) - keep_;
  for (int64_t i = 0; i < drop; ++i) {
    if (entries[i].second.filename() == entry.filename()) continue;
    std::error_code ec;
    fs::remove_all(entries[i].second, ec);
  }
}

std::optional<fs::path> Directory::latest() const {
  std::ifstream in(dir_ / "latest");
  std::string name;
  // Only an entry's name (step-NNNNNNNN[.h5]: no path, not "." or "..") is taken from the file.
  if (in && std::getline(in, name) && step_of(name) >= 0 && fs::exists(dir_ / name)) return dir_ / name;
  std::optional<fs::path> best;
  int64_t best_step = -1;
  if (!fs::is_directory(dir_)) return best;
  for (const auto& e : fs::directory_iterator(dir_)) {
    const int64_t s = step_of(e.path());
    if (s > best_step) best_step = s, best = e.path();
  }
  return best;
}

}  // namespace dtk::ckpt
