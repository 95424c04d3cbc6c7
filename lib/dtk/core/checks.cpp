#include "dtk/core/checks.h"

#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "dtk/core/error.h"

namespace dtk {
namespace {
namespace fs = std::filesystem;

std::string why(int err) { return std::strerror(err); }

// The directory that `p` (a file or a directory about to be made) would be created in.
fs::path parent_of(const fs::path& p) {
  const fs::path parent = p.parent_path();
  return parent.empty() ? fs::path(".") : parent;
}

// 0 when this process can create entries in the directory dir, else the errno: it makes a
// directory of a unique name there and removes it. Permission bits alone do not tell (root
// passes access(2) on /proc and on read-only mounts' directories, where mkdir then fails).
int cannot_create_in(const fs::path& dir) {
  std::string probe = (dir / ".dtk-probe-XXXXXX").string();
  if (::mkdtemp(probe.data()) == nullptr) return errno;
  ::rmdir(probe.c_str());
  return 0;
}

}  // namespace

void check_output_dir(const std::string& option, const std::string& path) {
  const std::string what = option + " " + path;
  if (path.empty()) fail_usage(option + ": an empty path");
  fs::path p(path);
  if (!p.has_filename()) p = p.parent_path();  // "ck/" is "ck"
  std::error_code ec;
  const fs::file_status st = fs::status(p, ec);
  if (fs::exists(st)) {
    if (!fs::is_directory(st)) fail_usage(what + ": exists and is not a directory");
    if (const int e = cannot_create_in(p)) fail_usage(what + ": the directory is not writable (" + why(e) + ")");
    return;
  }
  if (fs::exists(fs::symlink_status(p, ec))) fail_usage(what + ": a symbolic link to nothing");
  // Created with its missing parents: the nearest existing ancestor must be a writable directory.
  for (fs::path a = parent_of(p);; a = parent_of(a)) {
    const fs::file_status s = fs::status(a, ec);
    if (!fs::exists(s)) {
      if (a == a.root_path() || a == ".") fail_usage(what + ": cannot be created (" + a.string() + " is missing)");
      continue;
    }
    if (!fs::is_directory(s))
      fail_usage(what + ": cannot be created: " + a.string() + " is not a directory");
    if (const int e = cannot_create_in(a)) fail_usage(what + ": cannot be created in " + a.string() + " (" + why(e) + ")");
    return;
  }
}

void check_output_parent(const std::string& option, const std::string& path) {
  const std::string what = option + " " + path;
  if (path.empty()) fail_usage(option + ": an empty path");
  fs::path p(path);
  if (!p.has_filename()) p = p.parent_path();
  const fs::path dir = parent_of(p);
  std::error_code ec;
  const fs::file_status ds = fs::status(dir, ec);
  if (!fs::exists(ds)) fail_usage(what + ": the directory " + dir.string() + " does not exist");
  if (!fs::is_directory(ds)) fail_usage(what + ": " + dir.string() + " is not a directory");
  if (const int e = cannot_create_in(dir)) fail_usage(what + ": cannot write in " + dir.string() + " (" + why(e) + ")");
}

void check_output_file(const std::string& option, const std::string& path) {
  const std::string what = option + " " + path;
  if (path.empty()) fail_usage(option + ": an empty path");
  const fs::path p(path);
  std::error_code ec;
  const fs::file_status st = fs::status(p, ec);
  if (fs::is_directory(st) || !p.has_filename()) fail_usage(what + ": is a directory, not a file");
  check_output_parent(option, path);
  if (fs::exists(st) && ::access(p.c_str(), W_OK) != 0) fail_usage(what + ": not writable (" + why(errno) + ")");
}

}  // namespace dtk
