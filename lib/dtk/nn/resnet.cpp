// The resnet classifier (He et al. 2016) with basic blocks, in torchvision's layout and names so
// that an exported checkpoint loads into torchvision's ResNet (or the CIFAR variants built like
// it):
//   stem     conv1 (no bias) -> bn1 -> ReLU [-> 3x3 max pooling, stride 2: the "imagenet" stem]
//   layerS.I x -> conv1 (3x3, stride s) -> bn1 -> ReLU -> conv2 (3x3) -> bn2, plus the shortcut
//            (x, or downsample.0 (1x1, stride s) -> downsample.1 (batch norm) where the stride or
//            the width changes: torchvision's option B) -> ReLU
//   head     global average pooling -> fc -> mean cross-entropy
// Blocks: 0 = the stem, 1..n = the residual blocks in order, n + 1 = the head.
//
// Initialisation (Model::init; Philox, the same for a seed everywhere): convolutions
// normal(0, sqrt(2 / fan_out)) (torchvision's kaiming_normal_, mode fan_out), batch norm weights
// 1 and biases 0, fc.weight normal(0, 1 / sqrt(3 fan_in)) (the variance of PyTorch's default
// uniform), fc.bias 0. Buffers: every batch norm's running_mean (0) and running_var (1);
// torchvision's num_batches_tracked is not kept (momentum is fixed at 0.1, PyTorch's default, so
// nothing reads it; load_state_dict fills it in).
//
// Activations, per Checkpointing mode (the residual blocks; the stem and the head keep theirs):
//  - none: every block keeps, in its own object, conv1's output c1, h1 = relu(bn1(c1)), conv2's
//    output c2 and the shortcut convolution's output cd; the block outputs are kept in every mode.
//  - full: one object is rebound to each block in turn; backward reruns the block's forward from
//    its input (Pass::recompute: batch statistics again, running statistics untouched).
//  - selective: the convolution outputs (c1, c2, cd) are kept per block; h1, the cheap batch
//    norm and ReLU of c1, lives in one buffer that every block overwrites and is recomputed just
//    before the block's backward.
// Recomputation runs the same ops on the same inputs: the gradients are bit-identical in every mode.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "dtk/core/error.h"
#include "dtk/nn/internal.h"
#include "dtk/nn/layers.h"
#include "dtk/nn/model.h"
#include "dtk/ops/ops.h"

namespace dtk::nn {

namespace {

using detail::bad;

// One residual block as the model builds it.
struct BlockPlan {
  std::string prefix;  // "layer2.0."
  int64_t in = 0, out = 0, stride = 1;
  bool down = false;  // a downsample shortcut (stride or width changes)
  int64_t h = 0, w = 0, p = 0, q = 0;  // input and output sizes
  size_t first_param = 0, first_buffer = 0;
};

// The whole network's shapes (after resnet_validate's checks of the sizes).
struct Plan {
  ops::Window stem, pool;
  bool maxpool = false;
  int64_t c = 0, h = 0, w = 0;     // input
  int64_t w0 = 0, sh = 0, sw = 0;  // the stem's width and output size (after the pooling)
  std::vector<BlockPlan> blocks;
  int64_t last = 0;  // the last stage's width (fc's inputs)
};

ops::Window window(int64_t k, int64_t stride, int64_t pad) { return {k, k, stride, stride, pad, pad}; }

Plan make_plan(const ModelConfig& c) {
  Plan pl;
  pl.c = c.input_shape[0];
  pl.h = c.input_shape[1];
  pl.w = c.input_shape[2];
  pl.maxpool = c.stem == "imagenet";
  pl.stem = pl.maxpool ? window(7, 2, 3) : window(3, 1, 1);
  pl.pool = window(3, 2, 1);
  pl.w0 = c.stage_widths.at(0);
  pl.sh = pl.stem.out_h(pl.h);  // padding keeps every size at 1 or more
  pl.sw = pl.stem.out_w(pl.w);
  if (pl.maxpool) {
    pl.sh = pl.pool.out_h(pl.sh);
    pl.sw = pl.pool.out_w(pl.sw);
  }
  int64_t in = pl.w0, h = pl.sh, w = pl.sw;
  for (size_t s = 0; s < c.stage_widths.size(); ++s)
    for (int64_t i = 0; i < c.stage_blocks[s]; ++i) {
      BlockPlan b;
      b.prefix = fmt::format("layer{}.{}.", s + 1, i);
      b.in = in;
      b.out = c.stage_widths[s];
      b.stride = (s > 0 && i == 0) ? 2 : 1;
      b.down = b.stride != 1 || b.in != b.out;
      b.h = h;
      b.w = w;
      b.p = window(3, b.stride, 1).out_h(h);
      b.q = window(3, b.stride, 1).out_w(w);
      pl.blocks.push_back(b);
      in = b.out;
      h = b.p;
      w = b.q;
    }
  pl.last = in;
  return pl;
}

// ---------------------------------------------------------------------------- the parts

// conv1 -> bn1 -> ReLU [-> max pooling].
struct Stem {
  Conv2d conv;
  BatchNorm2d bn;
  ops::Window pool_win;
  bool pool = false;
  Buffer c_buf, h_buf, p_buf, arg_buf;
  Tensor c, h, p, argmax;

  void bind(std::vector<Param>& P, std::vector<NamedTensor>& B, const Plan& pl, double eps) {
    conv.bind(&P[0], pl.stem);
    bn.bind(&P[1], &P[2], B[0].value, B[1].value, eps);
    pool = pl.maxpool;
    pool_win = pl.pool;
  }

  // The stem's output (a view of its own buffers).
  Tensor forward(const Tensor& x, Pass pass) {
    const Shape cs = conv.out_shape(x.shape());
    c = c_buf.get(cs, x.dtype(), x.device());
    h = h_buf.get(cs, x.dtype(), x.device());
    conv.forward(x, c);
    bn.forward(c, h, pass);
    ops::relu_forward(h, h);
    if (!pool) return h;
    const Shape ps{cs[0], cs[1], pool_win.out_h(cs[2]), pool_win.out_w(cs[3])};
    p = p_buf.get(ps, x.dtype(), x.device());
    argmax = arg_buf.get(ps, DType::i32, x.device());
    ops::maxpool2d_forward(h, pool_win, p, argmax);
    return p;
  }

  // Parameter gradients from dout (the stem's input needs none). Workspace slots 0 and 1.
  void backward(const Tensor& dout, Workspace& ws) {
    Tensor dh = ws.get(0, h.shape(), h.dtype(), h.device());
    if (pool) {
      ops::maxpool2d_backward(argmax, dout, pool_win, dh);
      ops::relu_backward(h, dh, dh);
    } else {
      ops::relu_backward(h, dout, dh);
    }
    Tensor dc = ws.get(1, c.shape(), c.dtype(), c.device());
    bn.backward(dh, dc);
    conv.backward(dc, nullptr);
  }

  void release() {
    conv.release();
    bn.release();
    for (Buffer* b : {&c_buf, &h_buf, &p_buf, &arg_buf}) b->release();
    c = h = p = argmax = Tensor();
  }
};

// One basic block (see the top of the file).
struct Residual {
  Conv2d conv1, conv2, down;
  BatchNorm2d bn1, bn2, down_bn;
  bool has_down = false;
  Buffer c1_buf, h1_buf, c2_buf, cd_buf;
  Buffer* h1_shared = nullptr;  // selective: where h1 lives (not owned)
  Tensor c1, h1, c2, cd, out;

  void bind(std::vector<Param>& P, std::vector<NamedTensor>& B, const BlockPlan& b, double eps, const StatSync& sync) {
    const size_t i = b.first_param, j = b.first_buffer;
    conv1.bind(&P[i], window(3, b.stride, 1));
    bn1.bind(&P[i + 1], &P[i + 2], B[j].value, B[j + 1].value, eps);
    conv2.bind(&P[i + 3], window(3, 1, 1));
    bn2.bind(&P[i + 4], &P[i + 5], B[j + 2].value, B[j + 3].value, eps);
    has_down = b.down;
    if (has_down) {
      down.bind(&P[i + 6], window(1, b.stride, 0));
      down_bn.bind(&P[i + 7], &P[i + 8], B[j + 4].value, B[j + 5].value, eps);
    }
    for (BatchNorm2d* bn : {&bn1, &bn2, &down_bn}) bn->set_sync(sync);
  }

  // out = relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x)); tmp [out's shape] is scratch.
  void forward(const Tensor& x, Tensor& y, Tensor& tmp, Pass pass) {
    const Shape s = conv1.out_shape(x.shape());
    const DType t = x.dtype();
    const Device d = x.device();
    c1 = c1_buf.get(s, t, d);
    h1 = (h1_shared ? *h1_shared : h1_buf).get(s, t, d);
    c2 = c2_buf.get(s, t, d);
    conv1.forward(x, c1);
    bn1.forward(c1, h1, pass);
    ops::relu_forward(h1, h1);
    conv2.forward(h1, c2);
    bn2.forward(c2, y, pass);
    if (has_down) {
      cd = cd_buf.get(s, t, d);
      down.forward(x, cd);
      down_bn.forward(cd, tmp, pass);
      ops::add(y, tmp, y);
    } else {
      ops::add(y, x, y);
    }
    ops::relu_forward(y, y);
    out = y;
  }

  // Selective checkpointing: h1 again from the kept c1 (forward's ops on the same input).
  void recompute_h1() {
    h1 = h1_shared->get(c1.shape(), c1.dtype(), c1.device());
    bn1.forward(c1, h1, Pass::recompute);
    ops::relu_forward(h1, h1);
  }

  // Parameter gradients from dout; dx (the block input's gradient) overwritten. Workspace
  // slots 0..2.
  void backward(const Tensor& dout, Tensor& dx, Workspace& ws) {
    const DType t = out.dtype();
    const Device d = out.device();
    Tensor g = ws.get(0, out.shape(), t, d);  // at the sum: both branches get it
    ops::relu_backward(out, dout, g);         // out > 0 exactly where the sum is
    Tensor d2 = ws.get(1, c2.shape(), t, d);
    bn2.backward(g, d2);
    Tensor dh1 = ws.get(2, h1.shape(), t, d);
    conv2.backward(d2, &dh1);
    ops::relu_backward(h1, dh1, dh1);
    Tensor d1 = ws.get(1, c1.shape(), t, d);
    bn1.backward(dh1, d1);
    conv1.backward(d1, &dx);
    if (has_down) {
      Tensor dd = ws.get(1, cd.shape(), t, d);
      down_bn.backward(g, dd);
      Tensor dxs = ws.get(2, dx.shape(), t, d);
      down.backward(dd, &dxs);
      ops::axpy(1.0, dxs, dx);
    } else {
      ops::axpy(1.0, g, dx);
    }
  }

  void release() {
    for (Conv2d* c : {&conv1, &conv2, &down}) c->release();
    for (BatchNorm2d* b : {&bn1, &bn2, &down_bn}) b->release();
    for (Buffer* b : {&c1_buf, &h1_buf, &c2_buf, &cd_buf}) b->release();
    c1 = h1 = c2 = cd = out = Tensor();
  }
};

// Global average pooling -> fc -> cross-entropy.
struct Head {
  GlobalAvgPool pool;
  LinearLoss fc;
  Buffer pooled_buf, dpooled_buf;

  double forward(const Tensor& h, const Tensor& targets) {
    Tensor pooled = pooled_buf.get({h.dim(0), h.dim(1)}, h.dtype(), h.device());
    pool.forward(h, pooled);
    return fc.forward(pooled, targets);
  }

  // dh = d(scale * loss)/d(h), overwritten.
  void backward(double scale, Tensor& dh) {
    Tensor dpooled = dpooled_buf.get({dh.dim(0), dh.dim(1)}, dh.dtype(), dh.device());
    fc.backward(scale, &dpooled);
    pool.backward(dpooled, dh);
  }
};

// ---------------------------------------------------------------------------- the model

class ResNet final : public Model {
 public:
  ResNet(const ModelConfig& cfg, Device d, DType t, Storage s) : Model(cfg, d, t, s), plan_(make_plan(cfg)) {
    std::vector<std::tuple<std::string, Shape, int>> specs;
    std::vector<std::pair<std::string, Shape>> bufs;
    std::vector<std::pair<Init, double>> inits;
    const auto conv = [&](const std::string& name, int64_t out, int64_t in, int64_t k, int block) {
      specs.emplace_back(name, Shape{out, in, k, k}, block);
      inits.emplace_back(Init::normal, std::sqrt(2.0 / static_cast<double>(out * k * k)));
    };
    const auto bn = [&](const std::string& name, int64_t c, int block) {
      specs.emplace_back(name + ".weight", Shape{c}, block);
      specs.emplace_back(name + ".bias", Shape{c}, block);
      inits.emplace_back(Init::ones, 0.0);
      inits.emplace_back(Init::zeros, 0.0);
      bufs.emplace_back(name + ".running_mean", Shape{c});
      bufs.emplace_back(name + ".running_var", Shape{c});
    };
    const Plan& pl = plan_;
    conv("conv1.weight", pl.w0, pl.c, pl.stem.kh, 0);
    bn("bn1", pl.w0, 0);
    for (size_t i = 0; i < pl.blocks.size(); ++i) {
      BlockPlan& b = plan_.blocks[i];
      const int block = static_cast<int>(i + 1);
      b.first_param = specs.size();
      b.first_buffer = bufs.size();
      conv(b.prefix + "conv1.weight", b.out, b.in, 3, block);
      bn(b.prefix + "bn1", b.out, block);
      conv(b.prefix + "conv2.weight", b.out, b.out, 3, block);
      bn(b.prefix + "bn2", b.out, block);
      if (b.down) {
        conv(b.prefix + "downsample.0.weight", b.out, b.in, 1, block);
        bn(b.prefix + "downsample.1", b.out, block);
      }
    }
    const int head = static_cast<int>(pl.blocks.size() + 1);
    specs.emplace_back("fc.weight", Shape{cfg.classes, pl.last}, head);
    inits.emplace_back(Init::normal, 1.0 / std::sqrt(3.0 * static_cast<double>(pl.last)));
    specs.emplace_back("fc.bias", Shape{cfg.classes}, head);
    inits.emplace_back(Init::zeros, 0.0);
    build_params(specs);
    for (size_t i = 0; i < params_.size(); ++i) std::tie(params_[i].init, params_[i].init_std) = inits[i];
    build_buffers(bufs);

    stem_.bind(params_, buffers_, pl, cfg.norm_eps);
    eval_stem_.bind(params_, buffers_, pl, cfg.norm_eps);
    blocks_obj_.resize(pl.blocks.size());
    for (size_t i = 0; i < pl.blocks.size(); ++i) blocks_obj_[i].bind(params_, buffers_, pl.blocks[i], cfg.norm_eps, sync_);
    for (Head* h : {&head_, &eval_head_}) h->fc.bind(&params_[params_.size() - 2], &params_.back());
    add_blocks();
  }

  void set_batchnorm_sync(StatSync sync) override {
    sync_ = std::move(sync);
    stem_.bn.set_sync(sync_);
    for (size_t i = 0; i < blocks_obj_.size(); ++i)
      blocks_obj_[i].bind(params_, buffers_, plan_.blocks[i], config_.norm_eps, sync_);
  }

  int64_t correct() const override { return correct_; }
  // Under bf16: f32 weights and activations (batch norm and pooling stay f32), the convolutions'
  // and fc's operands rounded to bf16 (ops::Math::bf16).
  bool bf16_layers() const override { return false; }

 private:
  void begin(const Batch& batch, Pass pass, Checkpointing mode) override {
    if (pass == Pass::evaluate) {
      // Objects and buffers of its own: a pending backward stays valid.
      ein_ = input(batch, eval_x_buf_);
      eval_targets_ = batch.targets;
      return;
    }
    x_ = input(batch, x_buf_);
    targets_ = batch.targets;
    lay_out(mode);
    if (mode == Checkpointing::selective) {
      // One allocation for every block's h1, sized for the largest: each block's conv2 keeps a
      // view of it, which recompute_h1 refills (a reallocation would leave those views stale).
      int64_t most = 0;
      for (const BlockPlan& b : plan_.blocks) most = std::max(most, b.out * b.p * b.q);
      shared_h1_.get({x_.dim(0) * most}, dtype_, device_);
    }
    ins_.assign(plan_.blocks.size(), Tensor());
    outs_.resize(plan_.blocks.size());
    out_bufs_.resize(plan_.blocks.size());
  }

  // The blocks (see the top of the file): the stem, the residual blocks, the head. A training
  // forward passes in_ along (each residual block keeps its input and output in ins_ and outs_),
  // evaluation ein_; backward passes dh_ down.
  void add_blocks() {
    add_block({[this](Pass pass, Checkpointing) {
                 if (pass == Pass::evaluate)
                   ein_ = eval_stem_.forward(ein_, Pass::evaluate);
                 else
                   in_ = stem_.forward(x_, Pass::train);
                 return 0.0;
               },
               nullptr, [this](Checkpointing, double) { stem_.backward(dh_, ws_); }});
    for (size_t i = 0; i < plan_.blocks.size(); ++i)
      add_block({[this, i](Pass pass, Checkpointing mode) {
                   if (pass == Pass::evaluate) {
                     eval_block_.bind(params_, buffers_, plan_.blocks[i], config_.norm_eps, nullptr);
                     const Shape s = eval_block_.conv1.out_shape(ein_.shape());
                     Tensor out = eval_act_[i % 2].get(s, dtype_, device_), tmp = eval_tmp_.get(s, dtype_, device_);
                     eval_block_.forward(ein_, out, tmp, Pass::evaluate);
                     ein_ = out;
                     return 0.0;
                   }
                   Residual& r = block_for(i, mode);
                   const Shape s = r.conv1.out_shape(in_.shape());
                   outs_[i] = out_bufs_[i].get(s, dtype_, device_);
                   Tensor tmp = tmp_buf_.get(s, dtype_, device_);
                   r.forward(in_, outs_[i], tmp, Pass::train);
                   ins_[i] = in_;
                   in_ = outs_[i];
                   return 0.0;
                 },
                 [this, i](Checkpointing mode) {
                   if (mode == Checkpointing::full) {
                     Tensor tmp = tmp_buf_.get(outs_[i].shape(), dtype_, device_);
                     block_for(i, mode).forward(ins_[i], outs_[i], tmp, Pass::recompute);  // the same bits
                   } else {
                     blocks_obj_[i].recompute_h1();
                   }
                 },
                 [this, i](Checkpointing mode, double) {
                   // full: the shared object, bound to block i by the recomputation just before
                   Residual& r = mode == Checkpointing::full ? recompute_ : blocks_obj_[i];
                   dk_ ^= 1;
                   Tensor dx = dbuf_[dk_].get(ins_[i].shape(), dtype_, device_);
                   r.backward(dh_, dx, ws_);
                   dh_ = dx;
                 }});
    add_block({[this](Pass pass, Checkpointing) {
                 Head& h = pass == Pass::evaluate ? eval_head_ : head_;
                 const double loss = h.forward(pass == Pass::evaluate ? ein_ : in_,
                                               pass == Pass::evaluate ? eval_targets_ : targets_);
                 correct_ = h.fc.correct();
                 return loss;
               },
               nullptr, [this](Checkpointing, double scale) {
                 dk_ = 0;
                 dh_ = dbuf_[dk_].get(in_.shape(), dtype_, device_);
                 head_.backward(scale, dh_);
               }});
  }

  // The batch's images as [B, C, H, W] in the model's dtype (cast into buf when needed).
  Tensor input(const Batch& batch, Buffer& buf) {
    const Tensor& x = batch.inputs;
    const Tensor& y = batch.targets;
    const int64_t per = config_.sample_numel();
    if (!x.defined() || !dtype_is_float(x.dtype()) || x.ndim() < 1 || x.dim(0) < 1 || x.numel() != x.dim(0) * per)
      fail_usage("resnet: batch inputs must be float images [B, {}, {}, {}] with B >= 1, got {}", plan_.c, plan_.h,
                 plan_.w, x.defined() ? x.str() : "none");
    const int64_t B = x.dim(0);
    if (!y.defined() || y.dtype() != DType::i32 || y.numel() != B)
      fail_usage("resnet: batch targets must be i32 [{}] class ids, got {}", B, y.defined() ? y.str() : "none");
    if (x.device() != device_ || y.device() != device_)
      fail_usage("resnet: the batch is on " + x.device().str() + ", the model on " + device_.str());
    Tensor x4 = x.reshape({B, plan_.c, plan_.h, plan_.w});
    if (x.dtype() == dtype_) return x4;
    Tensor c = buf.get(x4.shape(), dtype_, device_);
    ops::cast(x4, c);
    return c;
  }

  // The object that runs block i in this mode: its own, or (full) the shared one rebound to it.
  Residual& block_for(size_t i, Checkpointing mode) {
    if (mode != Checkpointing::full) return blocks_obj_[i];
    recompute_.bind(params_, buffers_, plan_.blocks[i], config_.norm_eps, sync_);
    return recompute_;
  }

  // Sets the block objects up for mode when it differs from the last forward's, freeing what the
  // new mode does not use.
  void lay_out(Checkpointing mode) {
    if (mode == laid_out_) return;
    for (Residual& r : blocks_obj_) {
      r.release();
      r.h1_shared = mode == Checkpointing::selective ? &shared_h1_ : nullptr;
    }
    if (mode != Checkpointing::selective) shared_h1_.release();
    if (mode != Checkpointing::full) recompute_.release();
    laid_out_ = mode;
  }

  Plan plan_;
  StatSync sync_;
  Stem stem_, eval_stem_;
  std::vector<Residual> blocks_obj_;  // none and selective
  Residual recompute_, eval_block_;   // full checkpointing; evaluation
  Buffer shared_h1_;                  // selective
  Head head_, eval_head_;
  std::vector<Buffer> out_bufs_;
  std::vector<Tensor> ins_, outs_;  // of the last forward: each block's input and output
  Buffer x_buf_, eval_x_buf_, tmp_buf_, dbuf_[2], eval_act_[2], eval_tmp_;
  Workspace ws_;
  Tensor x_, targets_, in_;           // training: the images, their classes, the next block's input
  Tensor eval_targets_, ein_;         // evaluation: likewise
  Tensor dh_;                         // backward: the gradient passed down, in dbuf_[dk_]
  int dk_ = 0;
  int64_t correct_ = 0;
  Checkpointing laid_out_ = Checkpointing::none;
};

// The parameters of a validated config's network, in double (no overflow whatever the sizes).
double parameter_count(const ModelConfig& c) {
  const Plan pl = make_plan(c);
  const auto d = [](int64_t v) { return static_cast<double>(v); };
  double n = d(pl.w0) * d(pl.c * pl.stem.kh * pl.stem.kw) + 2 * d(pl.w0);
  for (const BlockPlan& b : pl.blocks)
    n += 9 * d(b.out) * d(b.in + b.out) + 4 * d(b.out) + (b.down ? d(b.out) * d(b.in) + 2 * d(b.out) : 0.0);
  return n + d(pl.last) * d(c.classes) + d(c.classes);
}

}  // namespace

namespace detail {

void resnet_validate(const ModelConfig& c) {
  if (c.input_shape.size() != 3)
    bad("input_shape must be [C, H, W] for arch resnet, got {} values", c.input_shape.size());
  for (size_t i = 0; i < 3; ++i)
    if (c.input_shape[i] <= 0 || c.input_shape[i] > (int64_t{1} << 20))
      bad("input_shape[{}] must be in [1, 2^20], got {}", i, c.input_shape[i]);
  if (c.classes <= 0) bad("classes must be positive for arch resnet, got {}", c.classes);
  if (c.classes > std::numeric_limits<int32_t>::max()) bad("classes ({}) must fit in i32", c.classes);
  if (c.stage_widths.empty() || c.stage_widths.size() != c.stage_blocks.size())
    bad("stage_widths and stage_blocks must be non-empty and of one length, got {} and {}", c.stage_widths.size(),
        c.stage_blocks.size());
  for (size_t i = 0; i < c.stage_widths.size(); ++i) {
    if (c.stage_widths[i] <= 0 || c.stage_widths[i] > (int64_t{1} << 20))
      bad("stage_widths[{}] must be in [1, 2^20], got {}", i, c.stage_widths[i]);
    if (c.stage_blocks[i] <= 0 || c.stage_blocks[i] > 1000)
      bad("stage_blocks[{}] must be in [1, 1000], got {}", i, c.stage_blocks[i]);
  }
  if (c.stem != "cifar" && c.stem != "imagenet") bad("stem must be \"cifar\" or \"imagenet\", got \"" + c.stem + "\"");
  if (!(c.norm_eps > 0) || !std::isfinite(c.norm_eps))
    bad("norm_eps (batch norm's epsilon) must be positive and finite, got {}", c.norm_eps);
  const double params = parameter_count(c);
  if (params > 1e13) bad("the sizes give about {} parameters, more than 1e13", params);
}

// Exact below 2^53, and resnet_validate bounds it by 1e13.
int64_t resnet_num_params(const ModelConfig& c) { return static_cast<int64_t>(parameter_count(c)); }

double resnet_train_flops(const ModelConfig& c) {
  // 6 x the multiply-adds of the convolutions and fc per sample (forward 2, backward 4), as for
  // the matmuls of the other models; batch norm, ReLU and pooling are not counted.
  const Plan pl = make_plan(c);
  const auto d = [](int64_t v) { return static_cast<double>(v); };
  double macs = d(pl.w0) * d(pl.c) * d(pl.stem.kh * pl.stem.kw) * d(pl.stem.out_h(pl.h)) * d(pl.stem.out_w(pl.w));
  for (const BlockPlan& b : pl.blocks)
    macs += d(b.p * b.q) * (9 * d(b.out) * d(b.in) + 9 * d(b.out) * d(b.out) + (b.down ? d(b.out) * d(b.in) : 0.0));
  macs += d(pl.last) * d(c.classes);
  return 6 * macs;
}

std::unique_ptr<Model> make_resnet(const ModelConfig& cfg, Device d, DType t, Storage s) {
  return std::make_unique<ResNet>(cfg, d, t, s);
}

}  // namespace detail

}  // namespace dtk::nn
