// The data a run trains and evaluates on (--data, --val-data, --augment, --micro-batch): each
// step's global batch from the sampler (a function of the seed and the step alone, so that 1, 2
// or 4 ranks see the same samples), of which this rank takes its rows, in micro-batches.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "dtk/core/device.h"
#include "dtk/core/tensor.h"
#include "dtk/data/dataset.h"
#include "dtk/nn/model.h"
#include "dtk/train/options.h"

namespace dtk::train {

class Batches {
 public:
  // f(batch on the device, its samples, the last micro-batch of the global batch).
  using Visit = std::function<void(const nn::Batch&, int64_t, bool)>;

  Batches(const Options& o, const nn::ModelConfig& cfg, int rank, int world, Device device);
  const data::Dataset& train() const { return *train_; }
  bool has_validation() const { return val_ != nullptr; }
  // This rank's rows of the training step's global batch, augmented (--augment).
  void train_step(int64_t step, const Visit& f) const;
  // This rank's rows of the b-th validation batch (the same every time).
  void validation(int64_t b, const Visit& f) const;

 private:
  void visit(const data::Dataset& ds, const std::vector<int64_t>& global, int64_t step, const Visit& f) const;

  const Options& o_;
  Device device_;
  mutable HostUpload upload_;  // a GPU's batches: pinned, asynchronous, the host's copies kept
  std::unique_ptr<data::Dataset> train_, val_;
  std::unique_ptr<data::Sampler> sampler_, val_sampler_;
  int64_t begin_ = 0, end_ = 0;       // this rank's rows of every global batch
  std::vector<int64_t> image_shape_;  // C, H, W of the training images (--augment)
};

}  // namespace dtk::train
