#include "dtk/train/batches.h"

#include <span>
#include <string>
#include <tuple>

#include "dtk/core/error.h"
#include "dtk/data/augment.h"

namespace dtk::train {

Batches::Batches(const Options& o, const nn::ModelConfig& cfg, int rank, int world, Device device)
    : o_(o), device_(device), upload_(device) {
  train_ = data::open_dataset(o.data.train, cfg, false, o.data.seed);
  if (o.data.augment != data::Augment::none) {
    const nlohmann::json d = train_->describe();
    if (!d.contains("image_shape"))
      fail_usage("--augment " + std::string(name_of(o.data.augment)) + " needs image data (a file from data-pack "
                 "mnist or cifar10); " + o.data.train + " holds none");
    image_shape_ = d["image_shape"].get<std::vector<int64_t>>();  // C, H, W
  }
  if (!o.data.val.empty()) val_ = data::open_dataset(o.data.val, cfg, true, o.data.seed);
  else if (o.data.train == "synthetic") val_ = data::open_dataset("synthetic", cfg, true, o.data.seed);
  sampler_ = std::make_unique<data::Sampler>(train_->size(), o.data.global_batch, o.data.seed);
  if (val_) val_sampler_ = std::make_unique<data::Sampler>(val_->size(), o.data.global_batch, o.data.seed + 1);
  std::tie(begin_, end_) = data::Sampler::shard(o.data.global_batch, rank, world);
}

void Batches::train_step(int64_t step, const Visit& f) const { visit(*train_, sampler_->global_indices(step), step, f); }

void Batches::validation(int64_t b, const Visit& f) const { visit(*val_, val_sampler_->global_indices(b), -1, f); }

// Rows [begin_, end_) of a global batch in micro-batches; a training step (step >= 0) augments them.
void Batches::visit(const data::Dataset& ds, const std::vector<int64_t>& global, int64_t step, const Visit& f) const {
  const int64_t n = end_ - begin_, mb = o_.data.micro_batch > 0 ? o_.data.micro_batch : n;
  for (int64_t i = 0; i < n; i += mb) {
    const int64_t k = std::min(mb, n - i);
    const std::span<const int64_t> idx{global.data() + begin_ + i, static_cast<size_t>(k)};
    nn::Batch b = ds.get(idx);
    if (step >= 0 && o_.data.augment != data::Augment::none)
      data::augment(b, o_.data.augment, image_shape_[0], image_shape_[1], image_shape_[2], idx, o_.data.seed, step);
    if (device_.is_cuda()) b = {upload_(b.inputs), upload_(b.targets), b.inputs, b.targets};
    f(b, k, i + k >= n);
  }
}

}  // namespace dtk::train
