// Training state spread over the ranks of a job, saved to and restored from one full checkpoint.
//
// Each piece of state is a named tensor with an owner: replicated (every rank holds the same
// value; rank 0's is written), owned by one rank (only that rank holds it: Shampoo's blocks),
// per rank (every rank holds its own value: PowerSGD's error buffers; stored under
// ranks/<r>/<name>), or sharded (every rank holds rows of dim 0 of it: fsdp-train's parameters
// and optimizer state). Owned state is stored by name, not by owner, so a run on another world
// size reassigns it on load; sharded state is read by rows, so a run on another world size
// reads its own rows from a full checkpoint or from a sharded state of any shard count.
#pragma once
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "dtk/ckpt/checkpoint.h"
#include "dtk/comm/comm.h"
#include "dtk/core/component.h"
#include "dtk/core/placed.h"

namespace dtk::ckpt {

inline constexpr int kReplicated = -1;
inline constexpr int kPerRank = -2;
inline constexpr int kSharded = -3;

struct StateEntry {
  std::string name;  // path in the file: "model/...", "optim/...", "compress/..."
  Tensor tensor;     // any device; sharded: this rank's rows
  int owner = kReplicated;  // kReplicated, kPerRank, kSharded or the owning rank
  // kSharded: the whole tensor's shape and every rank's rows of dim 0 (tensor holds rows
  // [offsets[rank], offsets[rank] + lengths[rank])).
  Shape shape{};
  std::vector<int64_t> offsets{}, lengths{};
  // kSharded: Rows::replicas (core/placed.h): the writing communicator has offsets.size() *
  // replicas ranks, rank r holds rows offsets[r % offsets.size()], and only the first
  // offsets.size() ranks write them.
  int replicas = 1;
  // A symmetric [d, d] matrix (Shampoo's factors and roots; not kSharded): stored packed, its
  // upper triangle row by row, a vector of d (d + 1) / 2 elements. load_state reads it back as
  // the whole matrix, and reads a stored [d, d] (checkpoints written before packing) as it is.
  bool symmetric = false;
  Resize resize = Resize::fresh;  // kPerRank: restored on another number of ranks how (core/placed.h)
};

// How completely load_state restored a state (core/component.h): the worst over the entries.
using dtk::Restored;

// A placed tensor (core/placed.h) as the entry that stores it: replicated, per rank, owned by
// its owner, or sharded with its rows.
StateEntry entry(const PlacedTensor& t);
std::vector<StateEntry> entries(const std::vector<PlacedTensor>& state);

// Writes a full checkpoint at `path`. Collective over `comm` (a host communicator): every rank
// passes its entries (replicated and per-rank ones in the same order everywhere; an owned entry
// only on its owner); rank 0 receives the others' entries one at a time and writes the file,
// atomically. When rank 0 fails, every rank throws AgreedError(rank 0's message, 1).
void save_state(const std::filesystem::path& path, const std::vector<StateEntry>& entries, const Metadata& meta,
                comm::Communicator& comm, WriteOptions opts = {});

// Writes a sharded state (a directory: rank files and index.h5, checkpoint.h) at `path`, every
// rank of `comm` writing its own file in parallel: sharded entries as rows, replicated ones in
// rank 0's file, per-rank ones (which may differ in names and shapes between ranks) whole in
// their rank's file under ranks/<r>/, owned ones (listed by their owner, this rank) whole in
// their owner's file under their own names. Collective; a write that
// fails on any rank fails it on every rank (AgreedError(the lowest failing rank's message, 1),
// no temporary left), before or at the commit.
void save_sharded_state(const std::filesystem::path& path, const std::vector<StateEntry>& entries,
                        const Metadata& meta, comm::Communicator& comm, WriteOptions opts = {});

// Host memory for snapshots of state (StateWrite's): one block, pinned (page-locked) when the
// state lives on a GPU so that the copies run at the bus's speed, grown when a snapshot needs
// more and reused by the next one (whose write must not begin before the previous one's ended).
class Snapshot {
 public:
  Snapshot() = default;
  ~Snapshot();
  Snapshot(const Snapshot&) = delete;
  Snapshot& operator=(const Snapshot&) = delete;
  // Host copies of `tensors`, views of the block: the copies from a GPU are queued on the
  // current stream and waited for (watched) before it returns.
  std::vector<Tensor> copy(const std::vector<Tensor>& tensors);
  // Makes room for copies of `tensors` now, its pages touched, so that the first copy (a
  // checkpoint step) does not pay for the allocation.
  void reserve(const std::vector<Tensor>& tensors);
  size_t bytes() const { return block_.bytes(); }

 private:
  void release();
  void ensure(size_t bytes, bool pinned);
  Tensor block_;
  bool pinned_ = false;
};

// A checkpoint write (full or sharded) in three parts, so that the second, the HDF5 files, can
// run on a thread of its own while training goes on (train's --async-checkpoint):
//   the constructor  collective over `comm`, on the caller's thread: what this rank writes is
//                    gathered in host memory: a full checkpoint's entries reach rank 0 from
//                    their owners, and with a Snapshot every entry this rank writes from its own
//                    state is copied into it, so that training may change the state at once
//                    (without one, the entries are written from where they live, as the caller
//                    waits). A sharded state's temporary directory and rank files are made.
//   write()          this rank alone, no communication: its files, renamed into place (a full
//                    checkpoint) or into the temporary directory (a sharded state). Returns ""
//                    or the error; at most once.
//   commit(error)    collective over `comm`, on the caller's thread again: the ranks agree on
//                    the errors (AgreedError(the lowest failing rank's, 1) on every rank, no
//                    temporary left), then a sharded state's index is written and its directory
//                    renamed into place.
// save_state and save_sharded_state are the three in a row.
class StateWrite {
 public:
  StateWrite(std::filesystem::path path, const std::vector<StateEntry>& entries, const Metadata& meta,
             comm::Communicator& comm, bool sharded, Snapshot* snapshot = nullptr, WriteOptions opts = {});
  ~StateWrite();
  StateWrite(const StateWrite&) = delete;
  StateWrite& operator=(const StateWrite&) = delete;
  std::string write() noexcept;
  void commit(const std::string& error);
  bool writes() const { return sharded_ || comm_.rank() == 0; }  // this rank has files to write
  bool sharded() const { return sharded_; }

 private:
  struct Item {
    std::string name;
    Tensor tensor;  // as stored (symmetric packed), on the host or the device
    int kind = kReplicated;  // full: unused; sharded: kSharded, kReplicated (rank 0), kPerRank or the owning rank
    Shape shape{};
    std::vector<int64_t> offsets{}, lengths{};
  };
  std::filesystem::path path_;
  Metadata meta_;
  comm::Communicator& comm_;
  bool sharded_;
  WriteOptions opts_;
  std::vector<Item> writes_;  // what this rank writes, in order
  std::unique_ptr<ShardedWriter> sw_;
  std::string error_;  // found while gathering: write() returns it
};

// Restores this rank's entries from a checkpoint: replicated and owned ones by name, per-rank
// ones from ranks/<rank>/<name>, sharded ones as rows of the stored whole tensor (rows
// offsets[rank % offsets.size()]: replicated shard groups read alike). When the
// checkpoint's per-rank state is of another number of ranks N than world_size (its metadata's
// extra.state_ranks, else its world_size), a per-rank entry follows its `resize`: the mean of
// ranks/<0..N-1>/<name> (summed in f64 in rank order, so every rank gets the same bits), or
// left as it is (fresh); an owned Resize::if_present entry the checkpoint does not hold is left
// as it is (fresh), on any number of ranks. Returns how completely it restored (Restored). Missing tensors and
// shape or dtype mismatches are UsageErrors naming them.
Restored load_state(const Reader& reader, std::vector<StateEntry>& entries, int rank, int world_size);

// The same for placed state (entries(state)): every piece of state as it declares itself.
inline void save_state(const std::filesystem::path& path, const std::vector<PlacedTensor>& state, const Metadata& meta,
                       comm::Communicator& comm, WriteOptions opts = {}) {
  save_state(path, entries(state), meta, comm, opts);
}
inline void save_sharded_state(const std::filesystem::path& path, const std::vector<PlacedTensor>& state,
                               const Metadata& meta, comm::Communicator& comm, WriteOptions opts = {}) {
  save_sharded_state(path, entries(state), meta, comm, opts);
}
// Restores into the placed tensors' storage.
inline Restored load_state(const Reader& reader, const std::vector<PlacedTensor>& state, int rank, int world_size) {
  std::vector<StateEntry> e = entries(state);
  return load_state(reader, e, rank, world_size);
}

}  // namespace dtk::ckpt
