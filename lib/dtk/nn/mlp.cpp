// The mlp classifier: input_dim -> hidden[0] -> ... -> classes, ReLU between the layers, mean
// cross-entropy over the batch. Parameters layers.i.weight [out, in] and layers.i.bias [out];
// layer i is block i. It keeps every activation (small); activation checkpointing is ignored.
#include <fmt/format.h>

#include <string>
#include <vector>

#include "dtk/core/error.h"
#include "dtk/nn/detail.h"
#include "dtk/nn/layers.h"
#include "dtk/nn/model.h"
#include "dtk/ops/ops.h"

namespace dtk::nn {

namespace {

class Mlp final : public Model {
 public:
  Mlp(const ModelConfig& cfg, Device d, DType t, Storage s) : Model(cfg, d, t, s) {
    std::vector<int64_t> sizes{cfg.input_dim};
    sizes.insert(sizes.end(), cfg.hidden.begin(), cfg.hidden.end());
    sizes.push_back(cfg.classes);
    std::vector<std::tuple<std::string, Shape, int>> specs;
    for (size_t i = 0; i + 1 < sizes.size(); ++i) {
      const std::string p = fmt::format("layers.{}.", i);
      specs.emplace_back(p + "weight", Shape{sizes[i + 1], sizes[i]}, static_cast<int>(i));
      specs.emplace_back(p + "bias", Shape{sizes[i + 1]}, static_cast<int>(i));
    }
    build_params(specs);
    std::vector<std::pair<Param*, Param*>> layers;
    for (size_t i = 0; i < params_.size(); i += 2) layers.emplace_back(&params_[i], &params_[i + 1]);
    net_.bind(layers);
    eval_net_.bind(layers);
  }

  double forward(const Batch& batch) override {
    pending_ = false;
    Tensor x = input(batch, x_buf_);
    batch_size_ = x.dim(0);
    const double loss = loss_.forward(net_.forward(x, &hooks(), Pass::train), batch.targets);
    correct_ = loss_.correct();
    pending_ = true;
    return loss;
  }

  void backward(double scale) override {
    if (!pending_) fail("mlp backward: no forward to differentiate (each backward needs its own forward)");
    pending_ = false;
    Tensor dlogits = dlogits_buf_.get({batch_size_, config_.classes}, dtype_, device_);
    loss_.backward(scale, dlogits);
    net_.backward(dlogits, &hooks());
  }

  double evaluate(const Batch& batch) override {
    // While a backward is pending, separate layer objects keep its activations intact.
    ReluMlp& net = pending_ ? eval_net_ : net_;
    CrossEntropy& loss = pending_ ? eval_loss_ : loss_;
    Tensor x = input(batch, pending_ ? eval_x_buf_ : x_buf_);
    const double l = loss.forward(net.forward(x, &hooks(), Pass::evaluate), batch.targets);
    correct_ = loss.correct();
    return l;
  }

  int64_t correct() const override { return correct_; }

 private:
  // The batch's inputs as [B, input_dim] in the model's dtype (cast into buf when needed).
  Tensor input(const Batch& batch, Buffer& buf) {
    const Tensor& x = batch.inputs;
    const Tensor& y = batch.targets;
    if (!x.defined() || !dtype_is_float(x.dtype()) || x.ndim() < 1 || x.dim(0) < 1 ||
        x.numel() != x.dim(0) * config_.input_dim)
      fail_usage("mlp: batch inputs must be float [B, {}] with B >= 1, got {}", config_.input_dim,
                 x.defined() ? x.str() : "none");
    const int64_t B = x.dim(0);
    if (!y.defined() || y.dtype() != DType::i32 || y.numel() != B)
      fail_usage("mlp: batch targets must be i32 [{}] class ids, got {}", B, y.defined() ? y.str() : "none");
    if (x.device() != device_ || y.device() != device_)
      fail_usage("mlp: the batch is on " + x.device().str() + ", the model on " + device_.str());
    Tensor x2 = x.reshape({B, config_.input_dim});
    if (x.dtype() == dtype_) return x2;
    Tensor c = buf.get(x2.shape(), dtype_, device_);
    ops::cast(x2, c);
    return c;
  }

  ReluMlp net_, eval_net_;
  CrossEntropy loss_, eval_loss_;
  Buffer x_buf_, eval_x_buf_, dlogits_buf_;
  int64_t batch_size_ = 0, correct_ = 0;
  bool pending_ = false;
};

}  // namespace

namespace detail {
std::unique_ptr<Model> make_mlp(const ModelConfig& cfg, Device d, DType t, Storage s) {
  return std::make_unique<Mlp>(cfg, d, t, s);
}
}  // namespace detail

}  // namespace dtk::nn
