// The mlp classifier: input_dim -> hidden[0] -> ... -> classes, ReLU between the layers, mean
// cross-entropy over the batch. Parameters layers.i.weight [out, in] and layers.i.bias [out];
// layer i (with the ReLU after it, or the loss after the last) is block i. It keeps every
// activation (small); activation checkpointing does not apply.
#include <fmt/format.h>

#include <string>
#include <vector>

#include "dtk/core/error.h"
#include "dtk/nn/internal.h"
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
    const size_t n = params_.size() / 2;  // the linear layers: the hidden ones and the last
    for (Net* net : {&net_, &eval_net_}) {
      net->hidden.resize(n - 1);
      net->z_buf.resize(n - 1);
      net->z.resize(n - 1);
      for (size_t i = 0; i + 1 < n; ++i) net->hidden[i].bind(&params_[2 * i], &params_[2 * i + 1]);
      net->last.bind(&params_[2 * n - 2], &params_[2 * n - 1]);
    }
    // Block i: layer i (its ReLU after it); the last block, the last layer and the loss.
    for (size_t i = 0; i + 1 < n; ++i)
      add_block({[this, i](Pass pass, Checkpointing) {
                   Net& net = pass == Pass::evaluate ? *eval_ : net_;
                   const Tensor& in = i == 0 ? net.x : net.z[i - 1];
                   net.z[i] = net.z_buf[i].get({in.dim(0), net.hidden[i].out_features()}, dtype_, device_);
                   net.hidden[i].forward(in, net.z[i]);
                   ops::relu_forward(net.z[i], net.z[i]);  // in place: relu's output is its own mask
                   return 0.0;
                 },
                 nullptr, [this, i](Checkpointing, double) {
                   ops::relu_backward(net_.z[i], dz_, dz_);  // in place
                   if (i == 0) {
                     net_.hidden[0].backward(dz_, nullptr);
                     return;
                   }
                   Tensor dx = dbuf_[i % 2].get(net_.z[i - 1].shape(), dtype_, device_);
                   net_.hidden[i].backward(dz_, &dx);
                   dz_ = dx;
                 }});
    add_block({[this, n](Pass pass, Checkpointing) {
                 Net& net = pass == Pass::evaluate ? *eval_ : net_;
                 const double loss = net.last.forward(n == 1 ? net.x : net.z.back(), net.targets);
                 correct_ = net.last.correct();
                 return loss;
               },
               nullptr, [this, n](Checkpointing, double scale) {
                 if (n == 1) return net_.last.backward(scale, nullptr);  // the input needs no gradient
                 dz_ = dbuf_[(n - 1) % 2].get(net_.z.back().shape(), dtype_, device_);
                 net_.last.backward(scale, &dz_);
               }});
  }

  int64_t correct() const override { return correct_; }

 private:
  // The layers and activations of one pass: training, or evaluation while a backward is pending.
  struct Net {
    std::vector<Linear> hidden;
    LinearLoss last;
    std::vector<Buffer> z_buf;
    std::vector<Tensor> z;  // z[i]: relu(layer i's output), the input of layer i + 1
    Buffer x_buf;
    Tensor x, targets;
  };

  void begin(const Batch& batch, Pass pass, Checkpointing) override {
    // Evaluation while a backward is pending: separate layer objects keep its activations intact.
    Net& net = pass == Pass::train || !backward_pending() ? net_ : eval_net_;
    if (pass == Pass::evaluate) eval_ = &net;
    net.x = input(batch, net.x_buf);
    net.targets = batch.targets;
  }

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

  Net net_, eval_net_;
  Net* eval_ = &net_;  // the evaluation's
  Buffer dbuf_[2];
  Tensor dz_;  // backward: the gradient passed down
  int64_t correct_ = 0;
};

}  // namespace

namespace detail {
std::unique_ptr<Model> make_mlp(const ModelConfig& cfg, Device d, DType t, Storage s) {
  return std::make_unique<Mlp>(cfg, d, t, s);
}
}  // namespace detail

}  // namespace dtk::nn
