// What the parts of the checkpoint implementation share (internal to ckpt): atomic.cpp
// (temporaries, atomic files), file.cpp (FileWriter, Reader), sharded.cpp (ShardedWriter,
// SerialShardedWriter) and directory.cpp (Directory). The interface is checkpoint.h.
#pragma once
#include <filesystem>

namespace dtk::ckpt {

inline constexpr const char* kStateId = "state_id";  // a sharded state's identity (checkpoint.h)

// fsync of a file, or of a directory (after a rename into it); an Error naming it on failure.
void fsync_path(const std::filesystem::path& p, bool directory);

}  // namespace dtk::ckpt
