// The llama model (docs/DESIGN.md, "Models"): token embedding, n_layers pre-norm transformer layers
// (RMSNorm, causal GQA attention with RoPE, RMSNorm, SwiGLU feed-forward, residuals), a final
// RMSNorm and an untied output projection; mean next-token cross-entropy.
//
// Blocks: 0 = tok_embeddings, 1..L = layers.0..layers.{L-1}, L + 1 = norm + output.
//
// Activations. The residual stream h_0..h_L (the input of every block after the embedding) is
// one buffer [L + 1, B, T, D], kept in every mode. Per mode (Checkpointing):
//  - none: every layer keeps its own activations (its own TransformerLayer object).
//  - full: one TransformerLayer object is rebound to each layer in turn, in forward and again in
//    backward, where it recomputes the layer's forward from h_l just before the layer's backward.
//  - selective: every layer keeps, in its own object, the outputs of its matmuls and of attention
//    (q, k, v after RoPE, out, lse, a = w1 x, b = w3 x); the cheap rest (xn1, xn2 and the norms'
//    rstd, h_mid, g = silu(a) * b) lives in one CheapScratch that every layer's forward
//    overwrites, and recompute_cheap refills it from h_l and the kept tensors just before the
//    layer's backward. wo's output (h_mid - h_in) is a matmul output too, but it is recomputed
//    rather than kept: the same gemm on the same inputs gives the same values (as full relies on
//    for every gemm), and keeping it would cost [B, T, D] per layer, as much as keeping h_mid.
// Recomputation runs the same ops on the same inputs, so the gradients are bit-identical in every
// mode. The head (norm + output + loss) keeps its activations in every mode.
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

constexpr size_t kParamsPerLayer = 9;  // attention_norm, wq, wk, wv, wo, ffn_norm, w1, w2, w3

size_t layer_first_param(int64_t l) { return 1 + kParamsPerLayer * static_cast<size_t>(l); }

// The activations that selective checkpointing recomputes rather than keeps: one set shared by
// every layer (only one layer's backward runs at a time).
struct CheapScratch {
  Buffer xn1, h_mid, xn2, g, rstd1, rstd2;

  void release() {
    for (Buffer* b : {&xn1, &h_mid, &xn2, &g, &rstd1, &rstd2}) b->release();
  }
};

// One pre-norm transformer layer: h_mid = h_in + attn(norm1(h_in)); h_out = h_mid + ffn(norm2(h_mid)).
struct TransformerLayer {
  RMSNorm attention_norm, ffn_norm;
  Attention attention;
  FeedForward feed_forward;
  Buffer xn1_buf, h_mid_buf, xn2_buf;
  Tensor xn1, h_mid, xn2;
  CheapScratch* cheap = nullptr;  // selective: where the cheap activations live (not owned)

  // Keep the cheap activations in s (selective checkpointing) or, with null, in this layer's own
  // buffers.
  void share(CheapScratch* s) {
    cheap = s;
    attention_norm.set_rstd_buffer(s ? &s->rstd1 : nullptr);
    ffn_norm.set_rstd_buffer(s ? &s->rstd2 : nullptr);
    feed_forward.set_g_buffer(s ? &s->g : nullptr);
  }

  void bind(std::vector<Param>& P, int64_t l, const ModelConfig& c) {
    const size_t i = layer_first_param(l);
    attention_norm.bind(&P[i], c.norm_eps);
    AttentionDims dims{c.n_heads, c.n_kv_heads, c.head_dim(), c.rope_theta};
    attention.bind(&P[i + 1], &P[i + 2], &P[i + 3], &P[i + 4], dims);
    ffn_norm.bind(&P[i + 5], c.norm_eps);
    feed_forward.bind(&P[i + 6], &P[i + 7], &P[i + 8]);
  }

  // h_in [B, T, D] -> h_out (the residual stream's dtype); tmp [B, T, D] is scratch in the
  // activations' dtype (the norms' outputs and the sublayers' take it). h_out may be tmp itself.
  void forward(const Tensor& h_in, Tensor& h_out, Tensor& tmp) {
    const DType act = tmp.dtype();
    xn1 = (cheap ? cheap->xn1 : xn1_buf).get(h_in.shape(), act, h_in.device());
    h_mid = (cheap ? cheap->h_mid : h_mid_buf).get(h_in.shape(), h_in.dtype(), h_in.device());
    xn2 = (cheap ? cheap->xn2 : xn2_buf).get(h_in.shape(), act, h_in.device());
    attention_norm.forward(h_in, xn1);
    attention.forward(xn1, tmp);
    ffn_norm.forward_add(h_in, tmp, h_mid, xn2);  // h_mid = h_in + tmp, one pass with the norm
    feed_forward.forward(xn2, tmp);
    ops::add(h_mid, tmp, h_out);
  }

  // Selective checkpointing, before backward: forward's cheap ops again on the same inputs (h_in,
  // the kept out, a and b), into the very tensors the forward saved (the sublayers' saved inputs
  // are views of xn1, xn2 and g), which other layers' forwards have overwritten since. tmp
  // [B, T, D] is scratch (wo's output).
  void recompute_cheap(const Tensor& h_in, Tensor& tmp) {
    if (!cheap || !xn1.defined()) fail("llama: selective recomputation without a selective forward");
    attention_norm.forward(h_in, xn1);
    attention.recompute_output(tmp);
    ffn_norm.forward_add(h_in, tmp, h_mid, xn2);
    feed_forward.recompute_g();
  }

  // dh: d(loss)/d(h_out) in, d(loss)/d(h_in) out (the norms' gradients added into it in the same
  // pass). Workspace slot 0, the sublayers' from 1.
  void backward(Tensor& dh, Workspace& ws) {
    Tensor dxn = ws.get(0, dh.shape(), dh.dtype(), dh.device());
    feed_forward.backward(dh, dxn, ws, 1);
    ffn_norm.backward(dxn, dh, /*accumulate=*/true);  // d h_mid
    attention.backward(dh, dxn, ws, 1);
    attention_norm.backward(dxn, dh, /*accumulate=*/true);  // d h_in
  }

  void release() {
    attention_norm.release();
    ffn_norm.release();
    attention.release();
    feed_forward.release();
    for (Buffer* b : {&xn1_buf, &h_mid_buf, &xn2_buf}) b->release();
    xn1 = h_mid = xn2 = Tensor();
  }
};

// norm + output + loss.
struct Head {
  RMSNorm norm;
  LinearLoss output;
  Buffer xf_buf;

  void bind(std::vector<Param>& P, const ModelConfig& c) {
    const size_t i = layer_first_param(c.n_layers);
    norm.bind(&P[i], c.norm_eps);
    output.bind(&P[i + 1]);
  }

  double forward(const Tensor& h, const Tensor& targets, DType act) {
    Tensor xf = xf_buf.get(h.shape(), act, h.device());
    norm.forward(h, xf);
    return output.forward(xf, targets);
  }

  // dh = d(scale * loss)/d(h), overwritten; dxf is scratch.
  void backward(double scale, Tensor& dxf, Tensor& dh) {
    output.backward(scale, &dxf);
    norm.backward(dxf, dh);
  }
};

class Llama final : public Model {
 public:
  Llama(const ModelConfig& cfg, Device d, DType t, Storage s) : Model(cfg, d, t, s) {
    const ModelConfig& c = config_;
    const int64_t D = c.dim, hd = c.head_dim(), L = c.n_layers;
    std::vector<std::tuple<std::string, Shape, int>> specs;
    specs.emplace_back("tok_embeddings.weight", Shape{c.vocab, D}, 0);
    for (int64_t l = 0; l < L; ++l) {
      const std::string p = fmt::format("layers.{}.", l);
      const int b = static_cast<int>(l + 1);
      specs.emplace_back(p + "attention_norm.weight", Shape{D}, b);
      specs.emplace_back(p + "attention.wq.weight", Shape{c.n_heads * hd, D}, b);
      specs.emplace_back(p + "attention.wk.weight", Shape{c.n_kv_heads * hd, D}, b);
      specs.emplace_back(p + "attention.wv.weight", Shape{c.n_kv_heads * hd, D}, b);
      specs.emplace_back(p + "attention.wo.weight", Shape{D, c.n_heads * hd}, b);
      specs.emplace_back(p + "ffn_norm.weight", Shape{D}, b);
      specs.emplace_back(p + "feed_forward.w1.weight", Shape{c.ffn_hidden, D}, b);
      specs.emplace_back(p + "feed_forward.w2.weight", Shape{D, c.ffn_hidden}, b);
      specs.emplace_back(p + "feed_forward.w3.weight", Shape{c.ffn_hidden, D}, b);
    }
    specs.emplace_back("norm.weight", Shape{D}, static_cast<int>(L + 1));
    specs.emplace_back("output.weight", Shape{c.vocab, D}, static_cast<int>(L + 1));
    build_params(specs);

    embed_.bind(&params_[0]);
    eval_embed_.bind(&params_[0]);
    layers_.resize(static_cast<size_t>(L));
    for (int64_t l = 0; l < L; ++l) layers_[static_cast<size_t>(l)].bind(params_, l, c);
    head_.bind(params_, c);
    eval_head_.bind(params_, c);

    // Block 0: the embedding, into h_0 (evaluation: into a).
    add_block({[this](Pass pass, Checkpointing) {
                 if (pass == Pass::evaluate)
                   eval_embed_.forward(eval_batch_.inputs, ea_);
                 else {
                   Tensor h0 = h_.select(0);
                   embed_.forward(batch_.inputs, h0);
                 }
                 return 0.0;
               },
               nullptr, [this](Checkpointing, double) { embed_.backward(dh_); }});
    // Blocks 1..L: the layers, h_l -> h_{l+1} (evaluation: a -> b, then swapped).
    for (int64_t l = 0; l < L; ++l)
      add_block({[this, l](Pass pass, Checkpointing mode) {
                   if (pass == Pass::evaluate) {
                     recompute_.bind(params_, l, config_);
                     recompute_.forward(ea_, eb_, etmp_);
                     std::swap(ea_, eb_);
                   } else {
                     Tensor out = h_.select(l + 1);
                     layer_for(l, mode).forward(h_.select(l), out, tmp_);
                   }
                   return 0.0;
                 },
                 [this, l](Checkpointing mode) {
                   Tensor tmp = tmp_buf_.get(h_.select(l).shape(), act_dtype(), device_);
                   if (mode == Checkpointing::full)
                     layer_for(l, mode).forward(h_.select(l), tmp, tmp);  // every activation, from h_l
                   else
                     layers_[static_cast<size_t>(l)].recompute_cheap(h_.select(l), tmp);  // the cheap ones
                 },
                 [this, l](Checkpointing mode, double) {
                   // full: the shared object, bound to layer l by the recomputation just before
                   (mode == Checkpointing::full ? recompute_ : layers_[static_cast<size_t>(l)]).backward(dh_, ws_);
                 }});
    // Block L + 1: the final norm, the output projection and the loss.
    add_block({[this, L](Pass pass, Checkpointing) {
                 if (pass == Pass::evaluate)
                   return (backward_pending() ? eval_head_ : head_).forward(ea_, eval_batch_.targets, act_dtype());
                 return head_.forward(h_.select(L), batch_.targets, act_dtype());
               },
               nullptr, [this, L](Checkpointing, double scale) {
                 const Tensor h_last = h_.select(L);
                 dh_ = dh_buf_.get(h_last.shape(), dtype_, device_);
                 Tensor dxf = ws_.get(0, h_last.shape(), dtype_, device_);
                 head_.backward(scale, dxf, dh_);
               }});
  }

 private:
  void begin(const Batch& batch, Pass pass, Checkpointing mode) override {
    const auto [B, T] = check_batch(batch);
    const int64_t L = config_.n_layers, D = config_.dim;
    if (pass == Pass::evaluate) {
      // Own buffers (2 x [B, T, D] of the residual stream, scratch [B, T, D]) and the recompute
      // layer: a pending backward stays valid.
      eval_batch_ = batch;
      Tensor bufs = eval_buf_.get({2, B, T, D}, dtype_, device_);
      ea_ = bufs.select(0), eb_ = bufs.select(1);
      etmp_ = eval_tmp_buf_.get({B, T, D}, act_dtype(), device_);
      return;
    }
    lay_out_layers(mode);
    batch_ = batch;
    h_ = resid_buf_.get({L + 1, B, T, D}, dtype_, device_);
    tmp_ = tmp_buf_.get({B, T, D}, act_dtype(), device_);
  }

  std::pair<int64_t, int64_t> check_batch(const Batch& batch) {
    const Tensor& x = batch.inputs;
    const Tensor& y = batch.targets;
    if (!x.defined() || x.dtype() != DType::i32 || x.ndim() != 2)
      fail_usage("llama: batch inputs must be i32 [B, T] token ids, got " + (x.defined() ? x.str() : "none"));
    const int64_t B = x.dim(0), T = x.dim(1);
    if (B < 1 || T < 1) fail_usage("llama: empty batch " + x.str());
    if (T > config_.seq_len)
      fail_usage("llama: batch sequence length {} exceeds the model's seq_len {}", T, config_.seq_len);
    if (!y.defined() || y.dtype() != DType::i32 || y.shape() != x.shape())
      fail_usage("llama: batch targets must be i32 " + shape_str(x.shape()) + " like the inputs, got " +
                 (y.defined() ? y.str() : "none"));
    if (x.device() != device_ || y.device() != device_)
      fail_usage("llama: the batch is on " + x.device().str() + ", the model on " + device_.str());
    const bool mirrored = batch.host_inputs.defined() && batch.host_inputs.shape() == x.shape();
    host_ids(mirrored ? batch.host_inputs : x, host_ids_, 0, config_.vocab, "llama: batch inputs (token ids)");
    return {B, T};
  }

  // The object that runs layer l in this mode: its own, or (full) the shared one rebound to it.
  TransformerLayer& layer_for(int64_t l, Checkpointing mode) {
    if (mode != Checkpointing::full) return layers_[static_cast<size_t>(l)];
    recompute_.bind(params_, l, config_);
    return recompute_;
  }

  // Sets the per-layer objects up for mode when it differs from the last forward's, freeing what
  // the new mode does not use: none keeps everything in each layer's own buffers, selective the
  // kept activations there and the cheap ones in cheap_, full nothing per layer (recompute_).
  void lay_out_layers(Checkpointing mode) {
    if (mode == layers_mode_) return;
    for (TransformerLayer& layer : layers_) {
      layer.release();
      layer.share(mode == Checkpointing::selective ? &cheap_ : nullptr);
    }
    if (mode != Checkpointing::selective) cheap_.release();
    layers_mode_ = mode;
  }

  Embedding embed_, eval_embed_;
  std::vector<TransformerLayer> layers_;  // none and selective
  TransformerLayer recompute_;            // full checkpointing and evaluation
  CheapScratch cheap_;                    // selective
  Head head_, eval_head_;                 // eval_head_ only while a backward is pending
  Buffer resid_buf_, tmp_buf_, dh_buf_, eval_buf_, eval_tmp_buf_, host_ids_;
  Workspace ws_;
  Batch batch_, eval_batch_;  // of the last training forward, of the evaluation
  Tensor h_, tmp_;            // [L + 1, B, T, D]: h_0..h_L of the last training forward; scratch
  Tensor dh_;                 // the gradient passed down the blocks in backward
  Tensor ea_, eb_, etmp_;     // evaluation: a block's input and output, scratch
  Checkpointing layers_mode_ = Checkpointing::none;  // what layers_ are set up for
};

}  // namespace

namespace detail {
std::unique_ptr<Model> make_llama(const ModelConfig& cfg, Device d, DType t, Storage s) {
  return std::make_unique<Llama>(cfg, d, t, s);
}
}  // namespace detail

}  // namespace dtk::nn
