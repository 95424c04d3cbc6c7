// Output paths are checked before any work starts, on every rank, leaving nothing behind
// (UsageError naming the option and the problem: exit 2). Whether a directory can be written is
// tried, not read from its permission bits: a directory of a unique name is made there and
// removed at once.
#pragma once
#include <string>

namespace dtk {

// A directory that the run creates if it is missing (--checkpoint-dir): the path must be a
// directory, or its nearest existing ancestor must be a directory that this process may write
// (so that a path through a regular file, or under a read-only directory, is refused).
void check_output_dir(const std::string& option, const std::string& path);
// The directory that a file or directory `path` is written into (as a temporary name, then
// renamed) exists and this process may write it.
void check_output_parent(const std::string& option, const std::string& path);
// A file that the run writes or appends to (--save, --metrics): not a directory;
// check_output_parent; the file itself, if it exists, is writable.
void check_output_file(const std::string& option, const std::string& path);

}  // namespace dtk
