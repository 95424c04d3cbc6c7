// dtk::parallel — how a job holds the model's parameters and aggregates their gradients: the
// trainer's whole view of parallelism (docs/DESIGN.md, "The model/parallelism seam"; torchtitan's rule: the trainer
// knows nothing of how parameters are placed). Two placements implement it:
//  - replicated (data_parallel.h, GradSync): every rank holds the whole model in the model's flat
//    buffers; gradients are all-reduced in buckets during backward, or compressed (psgd-train,
//    shampoo-train);
//  - sharded (fsdp.h, Fsdp): every rank holds dim-0 shards of every parameter; a block's
//    parameters are all-gathered before it runs and its gradients reduce-scattered after its
//    backward (fsdp-train).
// Either is the model's block hooks (nn::Model::set_hooks).
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <utility>
#include <vector>

#include "dtk/comm/comm.h"
#include "dtk/core/component.h"
#include "dtk/core/placed.h"
#include "dtk/nn/model.h"

namespace dtk::parallel {

// How a sharded tensor's rows of dim 0 are split over the ranks of a shard group (core/placed.h).
using Rows = dtk::Rows;

// A component of the run (core/component.h), and the holder of the others it runs (a
// compressor): components() lists them for --print-plan.
class Parallelism : public nn::BlockHooks, public Component {
 public:
  // The parameters as this rank holds them, in the model's order and with its names: whole
  // (replicated), or this rank's rows of dim 0 (sharded; possibly none). The optimizer steps
  // them, clipping measures them, checkpoints save them.
  virtual std::vector<nn::Param>& params() = 0;
  // The ranks over which an optimizer may split its work (Shampoo's blocks): the world when
  // replicated; the shard group when sharded (Shampoo gathers the shards' gradients over it and
  // computes the whole parameters' blocks, as the reference's lossless fully-sharded
  // distributors do; HSDP's replicas compute the same).
  virtual comm::Communicator& optimizer_comm() = 0;
  // The ranks that hold the same parameters (or rows) and sum their gradients: the world when
  // replicated, HSDP's replica groups when sharded (null: none). An optimizer that aggregates
  // some gradients itself (Dion's low-rank factors) does it over these.
  virtual comm::Communicator* replica_comm() { return nullptr; }
  // The parameters are sharded (params()[i] holds rows of dim 0): checkpoints are sharded states.
  virtual bool sharded() const { return false; }
  // params()[i]'s rows over the shard group; null: whole on every rank.
  virtual const Rows* rows(size_t i) const {
    (void)i;
    return nullptr;
  }
  // Every params()[i]'s rows (a Rows without offsets: whole), for the optimizer to place its
  // state like the parameters (optim::make_optimizer).
  std::vector<Rows> param_rows();
  // The model as a checkpoint keeps it, placed (core/placed.h): "model/<param>" for every
  // parameter (whole and replicated, or this rank's rows, sharded) and "model/<buffer>" for the
  // model's buffers (replicated: rank 0's).
  virtual std::vector<PlacedTensor> state() = 0;
  // The gradient synchronisation's own state, placed: a compressor's ("compress/..."); none by default.
  virtual std::vector<PlacedTensor> sync_state() { return {}; }
  // The same as a checkpoint saves it; collective over the world, on every rank, right before the
  // state is gathered for a save (fsdp-train's HSDP: a compressor's error buffers, per replica,
  // saved as their mean over the replicas, since one shard group writes).
  virtual std::vector<PlacedTensor> saved_sync_state() { return sync_state(); }
  // The rank and the number of ranks that per-rank state is indexed by: the shard group's when
  // sharded, else optimizer_comm()'s (the world).
  virtual std::pair<int, int> state_rank();
  // The initial values (nn::Model::init_param's): the same model for a seed on any world size.
  virtual void init(uint64_t seed) = 0;
  // After init or a checkpoint load, before the first step (replicated: broadcast from rank 0,
  // then a check that every rank holds the same bits).
  virtual void loaded() = 0;
  virtual void zero_grad() = 0;
  // Right before the step's last micro-batch's backward, and after it: on return from finish(),
  // params()' gradients hold the sum over ranks (each rank's gradients are scaled so that the
  // sum is the global-batch mean).
  virtual void begin(int64_t step) = 0;
  virtual void finish() = 0;
  // The L2 norm of the whole model's gradient (collective when sharded) into norm (f64 [1] on the
  // model's device); when max_norm > 0 and the norm exceeds it, every gradient is scaled by
  // max_norm / norm. On the device: the host waits for nothing (optim::clip_grad_norm).
  virtual void clip_grad_norm(double max_norm, Tensor& norm) = 0;
  // What the last step's metrics add (bytes sent, exposed communication, memory).
  virtual void metrics(nlohmann::ordered_json& m) const = 0;
  // Before each step (the automatic bucket plan is settled here, from the first steps' timings).
  virtual void before_step(int64_t step) { (void)step; }
  // After the optimizer's step of step `step` (DiLoCo's outer steps: diloco.h).
  virtual void after_step(int64_t step) { (void)step; }
  // After the trainer's one wait for the device at the step's end: the step's timers are read
  // here, where their events are complete (FSDP's; reading them earlier would wait for the GPU).
  virtual void collect_timings() {}
  // Around an evaluation: the model then holds the weights to evaluate (DiLoCo: the outer ones,
  // swapped in and back out).
  virtual void begin_evaluation() {}
  virtual void end_evaluation() {}
  // The optimizer's state placed as this placement's ranks hold it (DiLoCo: each replica's own).
  virtual std::vector<PlacedTensor> optimizer_state(std::vector<PlacedTensor> s) { return s; }
  // The run's components it holds: itself and the compressor it runs, if any.
  virtual std::vector<Component*> components() { return {this}; }
  // Sharded states are written by the ranks of this host communicator (one shard group), the
  // others skip the write; null: a full checkpoint through rank 0 of the world.
  virtual comm::Communicator* checkpoint_comm() { return nullptr; }

 protected:
  // The model's part of state(): params() placed by rows(i), then the model's buffers.
  std::vector<PlacedTensor> model_state(nn::Model& model);
};

}  // namespace dtk::parallel
