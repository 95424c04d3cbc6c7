// Training state spread over the ranks of a job, saved to and restored from one full checkpoint.
//
// Each piece of state is a named tensor with an owner: replicated (every rank holds the same
// value; rank 0's is written), owned by one rank (only that rank holds it: Shampoo's blocks),
// or per rank (every rank holds its own value: PowerSGD's error buffers; stored under
// ranks/<r>/<name>). Owned state is stored by name, not by owner, so a run on another world
// size reassigns it on load.
#pragma once
#include <filesystem>
#include <string>
#include <vector>

#include "dtk/ckpt/checkpoint.h"
#include "dtk/comm/comm.h"

namespace dtk::ckpt {

inline constexpr int kReplicated = -1;
inline constexpr int kPerRank = -2;

struct StateEntry {
  std::string name;  // path in the file: "model/...", "optim/...", "compress/..."
  Tensor tensor;     // any device
  int owner = kReplicated;  // kReplicated, kPerRank or the owning rank
};

// Writes a full checkpoint at `path`. Collective over `comm` (a host communicator): every rank
// passes its entries (replicated and per-rank ones in the same order everywhere; an owned entry
// only on its owner); rank 0 receives the others' entries one at a time and writes the file,
// atomically. Throws on every rank when rank 0 fails.
void save_state(const std::filesystem::path& path, const std::vector<StateEntry>& entries, const Metadata& meta,
                comm::Communicator& comm, WriteOptions opts = {});

// Restores this rank's entries from a checkpoint: replicated and owned ones by name, per-rank
// ones from ranks/<rank>/<name>. Per-rank entries are restored only when the checkpoint was
// written by a job of the same world size; otherwise they are left as they are and the function
// returns false. Missing tensors and shape or dtype mismatches are UsageErrors naming them.
bool load_state(const Reader& reader, std::vector<StateEntry>& entries, int rank, int world_size);

}  // namespace dtk::ckpt
