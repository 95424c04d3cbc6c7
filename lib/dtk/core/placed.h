// dtk — training state that declares its own placement over the ranks of a job.
//
// Every piece of training state (a parallelism's parameters and buffers, an optimizer's moments
// or Shampoo's blocks, a compressor's error feedback) lists itself as placed tensors: a name, the
// tensor as this rank holds it, and how it is spread over the ranks. Checkpoints (ckpt/state.h)
// write and restore what they are given; nothing above this header maps names to placements.
//   replicated  every rank that lists it holds the same value; rank 0's is written, every rank
//               restores it by name (also a copy of owned state on a rank that does not write it)
//   per_rank    every rank holds its own value (the compressors' error feedback): stored under
//               ranks/<r>/<name>; restored on as many ranks as wrote it, and on another number
//               of ranks as its `resize` says (below)
//   owned       one rank, `owner`, holds and writes it (Shampoo's blocks, also those cut from a
//               shard); stored by name, so a run on another world size reassigns it on load
//   sharded     every rank of a shard group holds rows of dim 0 (`rows`): fsdp's parameters and
//               the optimizer state shaped like them; read back by rows on any shard count. A
//               compressor's error buffers under HSDP are sharded and saved as their mean over
//               the replicas: `resize` mean_approximate says that this does not continue them
//               exactly (topk, signum; ckpt::load_state reports it). Rows::replicas > 1: the
//               shard group's rows are held alike by that many groups of consecutive ranks
//               (fsdp-train --sync: DiLoCo's outer weights) in a state that every rank writes
//               (its per-rank state too): the first group's ranks write the rows
// `symmetric` marks a [d, d] symmetric matrix (Shampoo's factors and roots), stored packed.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "dtk/core/tensor.h"

namespace dtk {

// How a sharded tensor's rows of dim 0 are split over the ranks of a shard group.
struct Rows {
  Shape shape;                            // the whole tensor's
  std::vector<int64_t> offsets, lengths;  // per rank of the shard group
  int rank = 0;                           // this rank's index in the shard group
  // Groups of offsets.size() consecutive ranks that hold these rows alike, when every rank of
  // them writes the state (ckpt::StateWrite): group 0's ranks write the rows, the others none.
  int replicas = 1;
};

enum class Placement { replicated, per_rank, owned, sharded };

// Per-rank state restored on another number of ranks than wrote it (ckpt::load_state):
//   fresh             left as the owner made it (it starts afresh): nothing can carry it over
//   mean              every rank takes the mean over the ranks that wrote it. Exact where the
//                     state enters the computation only through that mean, at this step and every
//                     later one: PowerSGD's and randomk's error feedback (compress/compressor.h)
//   mean_approximate  the same where it is not exact (topk's and signum's error feedback: each
//                     rank compresses its own M_r); ckpt::load_state reports it
// and owned state that older checkpoints may lack:
//   if_present        restored by name where the checkpoint holds it; a checkpoint without it
//                     leaves it as it is (Shampoo's blocks of sharded parameters, which fsdp-train
//                     before issue 32 cut from the shards under other names)
// (Owned state otherwise must be in the checkpoint, on any number of ranks.)
enum class Resize { fresh, mean, mean_approximate, if_present };

struct PlacedTensor {
  std::string name;  // unique within its owner's state ("exp_avg/<param>", "error/<param>", "step")
  Tensor value;      // as this rank holds it: restoring is copy_from into it
  Placement placement = Placement::replicated;
  int owner = -1;          // owned: the rank that writes it
  bool symmetric = false;  // a symmetric [d, d] matrix (not sharded)
  Rows rows{};             // sharded: value holds rows [rows.offsets[rows.rank], + rows.lengths[rows.rank])
  Resize resize = Resize::fresh;  // per_rank, owned: on another number of ranks
};

// The same tensors with `prefix` before their names ("optim/", "compress/": their checkpoint group).
inline std::vector<PlacedTensor> prefixed(const std::string& prefix, std::vector<PlacedTensor> state) {
  for (PlacedTensor& t : state) t.name = prefix + t.name;
  return state;
}

}  // namespace dtk
