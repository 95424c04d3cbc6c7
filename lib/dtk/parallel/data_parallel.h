// dtk::parallel — gradient synchronisation for replicated (data-parallel) parameters.
//
// Every rank holds the whole model. At start the parameters are broadcast from rank 0 and then
// checked equal everywhere by checksum. During the last micro-batch's backward, gradients are
// all-reduced in buckets (contiguous ranges of the model's flat gradient buffer, filled from the
// last parameter backwards, as backward produces them): a bucket's all-reduce starts as soon as
// the blocks it covers report their gradients final, so communication overlaps the rest of the
// backward pass. A compressor (compress/) replaces the all-reduce when one is chosen.
//
// Scaling convention (compress/compressor.h): each rank's gradients are its contribution, scaled
// so that the sum over ranks is the global-batch mean gradient; synchronisation sums.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "dtk/comm/comm.h"
#include "dtk/compress/compressor.h"
#include "dtk/nn/model.h"

namespace dtk::parallel {

// Broadcasts the model's values from rank 0, then checks every rank holds the same bits.
void broadcast_params(nn::Model& model, comm::Communicator& comm);
// Fails (naming `what` and the ranks' checksums) unless `t` holds the same bits on every rank.
void check_replicated(const Tensor& t, comm::Communicator& comm, const std::string& what);

class GradSync {
 public:
  virtual ~GradSync() = default;
  // During the last micro-batch's backward: block b's gradients are final.
  virtual void on_block_ready(int block) { (void)block; }
  // After backward: every rank's gradients hold the aggregate on return.
  virtual void finish(int64_t step) = 0;
  virtual compress::Bytes bytes() const = 0;  // of the last step
};

// Bucketed all-reduce (sum) overlapped with backward. bucket_bytes: the target bucket size.
std::unique_ptr<GradSync> make_allreduce_sync(nn::Model& model, comm::Communicator& comm, size_t bucket_bytes);
// Aggregation through a compressor after backward.
std::unique_ptr<GradSync> make_compressed_sync(nn::Model& model, compress::Compressor& compressor);

}  // namespace dtk::parallel
