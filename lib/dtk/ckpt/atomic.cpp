// Atomic writes (checkpoint.h): temporaries named by temp_name, dead writers' temporaries
// removed, write_file_atomic, fsync.
#include <fcntl.h>
#include <fmt/format.h>
#include <signal.h>
#include <sys/stat.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>
#include <sstream>

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

// The seconds since the epoch when the system booted (/proc/stat's btime); 0 when unknown.
double boot_time() {
  static const double t = [] {
    std::ifstream in("/proc/stat");
    std::string key;
    double v = 0;
    while (in >> key) {
      if (key == "btime" && in >> v) return v;
      in.ignore(std::numeric_limits<std::streamsize>::max(), '\n');
    }
    return 0.0;
  }();
  return t;
}

// Whether the process `pid` that wrote `temp` still runs. A pid that no longer exists, a zombie
// (killed, not yet reaped by its parent: a harness that kills a writer and starts the next
// command at once leaves one), and a pid reused by a process started after the temporary was
// last written (so not its writer) are dead. Without /proc, kill(pid, 0) alone decides.
bool writer_alive(long pid, const fs::path& temp) {
  if (pid <= 0) return false;
  if (::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) return false;
  std::ifstream in(fmt::format("/proc/{}/stat", pid));
  std::string stat;
  if (!std::getline(in, stat)) return true;  // no /proc: kill() said it exists
  const size_t close = stat.rfind(')');  // the command name in parentheses may hold anything
  if (close == std::string::npos) return true;
  std::istringstream fields(stat.substr(close + 1));
  std::string state, f;
  fields >> state;
  if (state == "Z" || state == "X") return false;
  for (int i = 0; i < 18 && fields >> f; ++i) {}  // fields 4..21; the start time is field 22
  double start_ticks = 0;
  const long hz = ::sysconf(_SC_CLK_TCK);
  struct stat st {};
  if (!(fields >> start_ticks) || hz <= 0 || boot_time() == 0 || ::stat(temp.c_str(), &st) != 0) return true;
  const double started = boot_time() + start_ticks / static_cast<double>(hz);
  const double written = static_cast<double>(st.st_mtim.tv_sec) + 1e-9 * static_cast<double>(st.st_mtim.tv_nsec);
  return started <= written + 2;  // btime has a resolution of one second
}
}  // namespace

int remove_stale_temporaries(const fs::path& dir) {
  int removed = 0;
  std::error_code ec;
  for (fs::directory_iterator it(dir.empty() ? fs::path(".") : dir, ec), end; !ec && it != end; it.increment(ec)) {
    const long pid = temp_owner(it->path().filename().string());
    if (pid < 0 || writer_alive(pid, it->path())) continue;
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
