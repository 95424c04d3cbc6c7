// Atomic writes (checkpoint.h): temporaries named by temp_name, dead writers' temporaries
// removed, write_file_atomic, fsync.
#include <fcntl.h>
#include <fmt/format.h>
#include <signal.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>

#include "dtk/ckpt/checkpoint.h"
#include "dtk/ckpt/internal.h"
#include "dtk/core/error.h"

namespace dtk::ckpt {
namespace fs = std::filesystem;

void fsync_path(const fs::path& p, bool directory) {
  const int fd = ::open(p.c_str(), directory ? O_RDONLY | O_DIRECTORY : O_RDONLY);
  if (fd < 0) fail("cannot open " + p.string() + " to sync it: " + std::strerror(errno));
  const int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0) fail("fsync of " + p.string() + " failed: " + std::strerror(errno));
}

// ------------------------------------------------------------------------------ temporaries

namespace {
constexpr const char* kTempTag = ".tmp-";

const std::string& host_name() {
  static const std::string name = [] {
    char buf[256] = {};
    if (::gethostname(buf, sizeof buf - 1) != 0 || !buf[0]) return std::string("localhost");
    return std::string(buf);
  }();
  return name;
}

bool all_digits(const std::string& s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

// The writer's pid of a temporary's name ".<name>.tmp-<host>-<pid>-<n>" made on this host; -1
// for any other name (another host's temporary, or not one of ours).
long temp_owner(const std::string& file) {
  const size_t tag = file.rfind(kTempTag);
  if (file.empty() || file[0] != '.' || tag == std::string::npos) return -1;
  const std::string rest = file.substr(tag + std::strlen(kTempTag));
  const size_t d2 = rest.rfind('-');
  if (d2 == std::string::npos || d2 == 0) return -1;
  const size_t d1 = rest.rfind('-', d2 - 1);
  if (d1 == std::string::npos) return -1;
  const std::string host = rest.substr(0, d1), pid = rest.substr(d1 + 1, d2 - d1 - 1), n = rest.substr(d2 + 1);
  if (host != host_name() || !all_digits(pid) || !all_digits(n) || pid.size() > 9) return -1;
  return std::stol(pid);
}

bool process_alive(long pid) { return pid > 0 && (::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH); }
}  // namespace

int remove_stale_temporaries(const fs::path& dir) {
  int removed = 0;
  std::error_code ec;
  for (fs::directory_iterator it(dir.empty() ? fs::path(".") : dir, ec), end; !ec && it != end; it.increment(ec)) {
    const long pid = temp_owner(it->path().filename().string());
    if (pid < 0 || process_alive(pid)) continue;
    std::error_code rm;
    if (fs::remove_all(it->path(), rm) > 0 && !rm) {
      spdlog::info("removed {}, a temporary left by a writer that no longer runs (pid {})", it->path().string(), pid);
      ++removed;
    }
  }
  return removed;
}

fs::path temp_name(const fs::path& dest) {
  static std::atomic<int> counter{0};
  const fs::path dir = dest.parent_path();
  remove_stale_temporaries(dir);
  return dir / fmt::format(".{}{}{}-{}-{}", dest.filename().string(), kTempTag, host_name(), ::getpid(), counter++);
}

void write_file_atomic(const fs::path& path, const std::string& text) {
  const fs::path tmp = temp_name(path);
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL, 0644);
  if (fd < 0) fail("cannot write " + path.string() + ": " + std::strerror(errno));
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    done += static_cast<size_t>(n);
  }
  const int err = done < text.size() || ::fsync(fd) != 0 ? errno : 0;
  if (::close(fd) != 0 || err) {
    const std::string why = std::strerror(err ? err : errno);
    std::error_code ec;
    fs::remove(tmp, ec);
    fail("cannot write " + path.string() + ": " + why);
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) {
    const std::string why = ec.message();
    fs::remove(tmp, ec);
    fail("cannot rename " + tmp.string() + " to " + path.string() + ": " + why);
  }
  fsync_path(path.parent_path().empty() ? fs::path(".") : path.parent_path(), true);
}

}  // namespace dtk::ckpt
