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
#include "dtk/parallel/parallelism.h"

namespace dtk::parallel {

// Broadcasts the model's values from rank 0, then checks every rank holds the same bits.
void broadcast_params(nn::Model& model, comm::Communicator& comm);
// Fails (naming `what` and the ranks' checksums) unless `t` holds the same bits on every rank.
void check_replicated(const Tensor& t, comm::Communicator& comm, const std::string& what);

// The replicated placement (parallelism.h) and one gradient path for every data-parallel step:
// the compressor's buckets start as the blocks they cover report their gradients final during
// the last micro-batch's backward (a plain all-reduce on plain steps, PowerSGD's P and Q on
// compressed ones), and finish() completes them after backward. Between begin() and finish(),
// after_backward(b) starts the buckets whose blocks are all final. The model has flat storage.
class GradSync final : public Parallelism {
 public:
  // With a compressor (owned by the caller, or by this), or without: a plain bucketed all-reduce (sum).
  GradSync(nn::Model& model, comm::Communicator& comm, compress::Compressor& compressor);
  GradSync(nn::Model& model, comm::Communicator& comm, std::unique_ptr<compress::Compressor> compressor);
  // local: per parameter, 1 where the optimizer aggregates the gradient itself (Dion's factors):
  // left out of the all-reduce, each rank keeping its own contribution.
  GradSync(nn::Model& model, comm::Communicator& comm, size_t bucket_bytes, std::vector<char> local = {});
  std::vector<nn::Param>& params() override { return model_.params(); }
  comm::Communicator& optimizer_comm() override { return comm_; }
  comm::Communicator* replica_comm() override { return &comm_; }
  // The model's parameters (replicated) and buffers; a compressor's state (not the plain all-reduce's).
  std::vector<PlacedTensor> state() override { return model_state(model_); }
  std::vector<PlacedTensor> sync_state() override;
  void init(uint64_t seed) override { model_.init(seed); }
  void loaded() override { broadcast_params(model_, comm_); }
  void zero_grad() override { model_.zero_grad(); }
  // Right before the last micro-batch's backward of step `step`.
  void begin(int64_t step) override;
  // During it: block b's gradients are final (ignored outside begin() .. finish()).
  void after_backward(int block) override;
  // After backward: every rank's gradients hold the aggregate on return.
  void finish() override;
  // Over the synchronised gradients only (those left local differ between ranks).
  void clip_grad_norm(double max_norm, Tensor& norm) override;
  // comm_bytes; with a compressor also comm_bytes_uncompressed and compression_ratio; with one
  // that plans (auto) compress_ranks.
  void metrics(nlohmann::ordered_json& m) const override;
  std::string_view component_name() const override { return "data_parallel"; }
  // Its synchronisation state is the compressor's, and so is what a resume says of it.
  std::string restore_note(Restored outcome, const RestoreSource& from) const override {
    return c_.restore_note(outcome, from);
  }
  std::vector<Component*> components() override {
    if (!compressed_) return {this};
    return {this, &c_};
  }
  compress::Bytes bytes() const { return c_.last_bytes(); }  // of the last step

 private:
  void init();
  std::vector<nn::Param>& synced();  // the parameters the compressor aggregates
  nn::Model& model_;
  comm::Communicator& comm_;
  std::vector<nn::Param> synced_;  // with local parameters: the others
  bool all_synced_ = true;
  std::unique_ptr<compress::Compressor> owned_;
  compress::Compressor& c_;
  bool compressed_ = false;  // a compressor chosen by the program (not the plain all-reduce)
  std::vector<int> min_block_;  // per bucket: the lowest block it covers (ready once that block is)
  size_t next_ = 0;             // the next bucket to start
  bool armed_ = false;          // between begin() and finish()
};

}  // namespace dtk::parallel
