// ModelConfig (JSON, validation, sizes), the presets, the parameter storage shared by every
// model, and make_model.
#include "dtk/nn/model.h"

#include <fmt/format.h>

#include <cmath>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <utility>

#include "dtk/core/error.h"
#include "dtk/nn/internal.h"
#include "dtk/nn/layers.h"
#include "dtk/ops/ops.h"

namespace dtk::nn {

using detail::bad;

namespace {

void need_positive(const char* field, int64_t v, Arch arch) {
  if (v <= 0) bad("{} must be positive for arch {}, got {}", field, name_of(arch), v);
}

}  // namespace

// ---------------------------------------------------------------------------- ModelConfig

void ModelConfig::validate() const {
  if (arch == Arch::llama) {
    need_positive("dim", dim, arch);
    need_positive("n_layers", n_layers, arch);
    need_positive("n_heads", n_heads, arch);
    need_positive("n_kv_heads", n_kv_heads, arch);
    need_positive("ffn_hidden", ffn_hidden, arch);
    need_positive("vocab", vocab, arch);
    need_positive("seq_len", seq_len, arch);
    if (dim % n_heads != 0) bad("dim ({}) must be a multiple of n_heads ({})", dim, n_heads);
    if (n_heads % n_kv_heads != 0)
      bad("n_heads ({}) must be a multiple of n_kv_heads ({})", n_heads, n_kv_heads);
    if (head_dim() % 2 != 0)
      bad("the head dim dim / n_heads ({} / {} = {}) must be even: RoPE rotates pairs", dim, n_heads, head_dim());
    if (vocab > std::numeric_limits<int32_t>::max()) bad("vocab ({}) must fit token ids in i32", vocab);
    if (!(rope_theta > 0) || !std::isfinite(rope_theta))
      bad("rope_theta must be positive and finite, got {}", rope_theta);
    if (!(norm_eps >= 0) || !std::isfinite(norm_eps))
      bad("norm_eps must be non-negative and finite, got {}", norm_eps);
  } else if (arch == Arch::mlp) {
    need_positive("input_dim", input_dim, arch);
    need_positive("classes", classes, arch);
    for (size_t i = 0; i < hidden.size(); ++i)
      if (hidden[i] <= 0) bad("hidden[{}] must be positive, got {}", i, hidden[i]);
    if (classes > std::numeric_limits<int32_t>::max()) bad("classes ({}) must fit in i32", classes);
  } else if (arch == Arch::resnet) {
    detail::resnet_validate(*this);
  } else {
    bad("arch must be {}, got {}", choices_of<Arch>(), static_cast<int>(arch));
  }
  // Sizes whose parameter count does not fit comfortably (computed in double: no overflow).
  double total = 0;
  if (arch == Arch::llama) {
    const double D = static_cast<double>(dim), hd = static_cast<double>(head_dim());
    total = 2.0 * static_cast<double>(vocab) * D + D +
            static_cast<double>(n_layers) *
                (2 * D + 2 * D * static_cast<double>(n_heads) * hd + 2 * D * static_cast<double>(n_kv_heads) * hd +
                 3 * D * static_cast<double>(ffn_hidden));
  } else if (arch == Arch::mlp) {
    double in = static_cast<double>(input_dim);
    for (int64_t h : hidden) {
      total += (in + 1) * static_cast<double>(h);
      in = static_cast<double>(h);
    }
    total += (in + 1) * static_cast<double>(classes);
  }  // resnet: resnet_validate bounds its sizes
  if (total > 1e13) bad("the sizes give {} parameters, more than 1e13", total);
}

int64_t ModelConfig::num_params() const {
  if (arch == Arch::llama) {
    const int64_t hd = head_dim();
    const int64_t per_layer = 2 * dim + dim * n_heads * hd * 2 + 2 * dim * n_kv_heads * hd + 3 * dim * ffn_hidden;
    return 2 * vocab * dim + dim + n_layers * per_layer;
  }
  if (arch == Arch::mlp) {
    int64_t total = 0, in = input_dim;
    for (int64_t h : hidden) {
      total += (in + 1) * h;
      in = h;
    }
    return total + (in + 1) * classes;
  }
  if (arch == Arch::resnet) return detail::resnet_num_params(*this);
  return 0;
}

int64_t ModelConfig::sample_numel() const {
  if (arch == Arch::mlp) return input_dim;
  if (arch == Arch::resnet && input_shape.size() == 3) return input_shape[0] * input_shape[1] * input_shape[2];
  return 0;
}

double ModelConfig::train_flops_per_item() const {
  if (arch == Arch::llama) {
    // Matmul weights (every linear, the output head; not the embedding table or the norms),
    // plus attention's two T x T products per layer (QK^T and PV: 2 * 2 * seq_len * dim per token
    // forward), times 3 for forward + backward, as in PaLM's MFU accounting (no causal discount).
    const double D = static_cast<double>(dim), hd = static_cast<double>(head_dim());
    const double per_layer = 2 * D * static_cast<double>(n_heads) * hd +
                             2 * D * static_cast<double>(n_kv_heads) * hd + 3 * D * static_cast<double>(ffn_hidden);
    const double matmul = static_cast<double>(n_layers) * per_layer + static_cast<double>(vocab) * D;
    return 6 * matmul + 12 * static_cast<double>(n_layers) * D * static_cast<double>(seq_len);
  }
  if (arch == Arch::mlp) {
    double total = 0, in = static_cast<double>(input_dim);
    for (int64_t h : hidden) {
      total += in * static_cast<double>(h);
      in = static_cast<double>(h);
    }
    return 6 * (total + in * static_cast<double>(classes));
  }
  if (arch == Arch::resnet) return detail::resnet_train_flops(*this);
  return 0;
}

// ---------------------------------------------------------------------------- sizes given

ModelConfig with_sizes(ModelConfig c, const SizeOptions& o) {
  const std::string& name = c.preset;
  if (!o.input_shape.empty() && c.arch != Arch::resnet) fail_usage("--input-shape applies to resnet models, not " + name);
  if (c.arch == Arch::resnet) {
    if (o.dim || o.layers || o.heads || o.kv_heads || o.ffn_hidden || o.vocab || o.seq_len || o.input_dim)
      fail_usage("--dim, --layers, --heads, --kv-heads, --ffn-hidden, --vocab, --seq-len and --input-dim do not apply "
                 "to " + name + " (its sizes are the preset's; --input-shape and --classes set its input and output)");
    if (!o.input_shape.empty()) c.input_shape = o.input_shape;
    if (o.classes) c.classes = *o.classes;
  } else if (c.arch == Arch::llama) {
    if (o.input_dim || o.classes) fail_usage("--input-dim and --classes apply to mlp models, not " + name);
    if (o.dim) c.dim = *o.dim;
    if (o.layers) c.n_layers = *o.layers;
    if (o.heads) c.n_heads = *o.heads;
    if (o.kv_heads) c.n_kv_heads = *o.kv_heads;
    if (o.ffn_hidden) c.ffn_hidden = *o.ffn_hidden;
    if (o.vocab) c.vocab = *o.vocab;
    if (o.seq_len) c.seq_len = *o.seq_len;
  } else {
    if (o.heads || o.kv_heads || o.ffn_hidden || o.vocab || o.seq_len)
      fail_usage("--heads, --kv-heads, --ffn-hidden, --vocab and --seq-len apply to llama models, not " + name);
    if (o.dim || o.layers) {
      const int64_t width = o.dim ? *o.dim : (c.hidden.empty() ? 64 : c.hidden[0]);
      const size_t n = o.layers ? static_cast<size_t>(*o.layers) : c.hidden.size();
      c.hidden.assign(n, width);
    }
    if (o.input_dim) c.input_dim = *o.input_dim;
    if (o.classes) c.classes = *o.classes;
  }
  c.validate();
  return c;
}

ModelConfig restated(ModelConfig c, const SizeOptions& o) {
  auto same = [&](const char* opt, const std::optional<int64_t>& v, int64_t have) {
    if (v && *v != have)
      fail_usage("{} {} contradicts the checkpoint's model ({}); leave the size options out to use the checkpoint's",
                 opt, *v, have);
  };
  same("--dim", o.dim, c.dim);
  same("--heads", o.heads, c.n_heads);
  same("--kv-heads", o.kv_heads, c.n_kv_heads);
  same("--ffn-hidden", o.ffn_hidden, c.ffn_hidden);
  same("--vocab", o.vocab, c.vocab);
  same("--input-dim", o.input_dim, c.input_dim);
  same("--classes", o.classes, c.classes);
  if (!o.input_shape.empty() && o.input_shape != c.input_shape)
    fail_usage("--input-shape " + shape_str(o.input_shape) + " contradicts the checkpoint's model (" +
               shape_str(c.input_shape) + ")");
  if (c.arch == Arch::llama) same("--layers", o.layers, c.n_layers);
  if (o.seq_len) c.seq_len = *o.seq_len;
  c.validate();
  return c;
}

// ---------------------------------------------------------------------------- presets

ModelConfig llama_config(int64_t dim, int64_t layers, int64_t heads, int64_t kv_heads, int64_t ffn_hidden, int64_t vocab,
                         int64_t seq_len, double rope_theta) {
  ModelConfig c;
  c.arch = Arch::llama;
  c.dim = dim;
  c.n_layers = layers;
  c.n_heads = heads;
  c.n_kv_heads = kv_heads;
  c.ffn_hidden = ffn_hidden;
  c.vocab = vocab;
  c.seq_len = seq_len;
  c.rope_theta = rope_theta;
  return c;
}

namespace {

ModelConfig llama(const char* name, int64_t dim, int64_t layers, int64_t heads, int64_t kv_heads, int64_t ffn,
                  int64_t vocab, int64_t seq_len, double theta) {
  ModelConfig c = llama_config(dim, layers, heads, kv_heads, ffn, vocab, seq_len, theta);
  c.preset = name;
  return c;
}

ModelConfig mlp(const char* name, int64_t input, std::vector<int64_t> hidden, int64_t classes) {
  ModelConfig c;
  c.arch = Arch::mlp;
  c.preset = name;
  c.input_dim = input;
  c.hidden = std::move(hidden);
  c.classes = classes;
  return c;
}

ModelConfig resnet(const char* name, std::vector<int64_t> widths, std::vector<int64_t> blocks) {
  ModelConfig c;
  c.arch = Arch::resnet;
  c.preset = name;
  c.input_shape = {3, 32, 32};
  c.classes = 10;
  c.stage_widths = std::move(widths);
  c.stage_blocks = std::move(blocks);
  c.stem = "cifar";
  return c;
}

const std::map<std::string, ModelConfig>& presets() {
  static const std::map<std::string, ModelConfig> p = {
      // ~0.85M: quick to train on a CPU.
      {"llama-tiny", llama("llama-tiny", 128, 4, 4, 2, 384, 256, 64, 10000.0)},
      // ~27.8M.
      {"llama-small", llama("llama-small", 512, 8, 8, 4, 1408, 4096, 256, 10000.0)},
      // Llama-3.2-1B-like sizes with a 32000-token vocabulary (untied output): ~1.10B.
      {"llama-1b", llama("llama-1b", 2048, 16, 32, 8, 8192, 32000, 2048, 10000.0)},
      // Meta's Llama 3.2 1B and Llama 3 8B shapes, with Llama 3's 128256-token vocabulary (token
      // ids above 65535: token files store them as u32) and RoPE theta 500000; sequence length
      // 2048 for llama3-1b (a batch for one GPU), Llama 3 8B's 8192 for llama3-8b. dtk's RoPE has
      // no Llama 3.1/3.2 frequency scaling (rope_scaling "llama3"), and dtk's llama does not tie
      // the output to the embedding: Llama 3.2 1B ties them (1,235,814,400 parameters), llama3-1b
      // has its own output.weight, 262,668,288 more (1,498,482,688). Llama 3 8B has no tying:
      // llama3-8b is its 8,030,261,248.
      {"llama3-1b", llama("llama3-1b", 2048, 16, 32, 8, 8192, 128256, 2048, 500000.0)},
      {"llama3-8b", llama("llama3-8b", 4096, 32, 32, 8, 14336, 128256, 8192, 500000.0)},
      {"mlp-small", mlp("mlp-small", 32, {64, 64}, 10)},
      {"mlp-mnist", mlp("mlp-mnist", 784, {256, 128}, 10)},
      // He et al. (2016) section 4.2: 6n + 2 layers, widths 16, 32, 64 (n = 1 and n = 3).
      {"resnet-8", resnet("resnet-8", {16, 32, 64}, {1, 1, 1})},
      {"resnet-20", resnet("resnet-20", {16, 32, 64}, {3, 3, 3})},
      // ResNet-18 with a 3x3 stride-1 stem and no max pooling, as the PowerSGD paper trains on
      // CIFAR-10 (11,173,962 parameters).
      {"resnet-18", resnet("resnet-18", {64, 128, 256, 512}, {2, 2, 2, 2})},
  };
  return p;
}

}  // namespace

std::vector<std::string> preset_names() {
  std::vector<std::string> names;
  for (const auto& [name, cfg] : presets()) names.push_back(name);
  return names;
}

ModelConfig preset(const std::string& name) {
  auto it = presets().find(name);
  if (it == presets().end()) {
    std::string list;
    for (const std::string& n : preset_names()) list += (list.empty() ? "" : ", ") + n;
    fail_usage("unknown model preset \"" + name + "\"; the presets are: " + list);
  }
  return it->second;
}

// ---------------------------------------------------------------------------- Model

Param& Model::param(const std::string& name) {
  for (Param& p : params_)
    if (p.name == name) return p;
  fail_usage("model has no parameter named \"" + name + "\"");
}

void Model::zero_grad() {
  if (grads_.defined() && grads_.numel() > 0) ops::fill(grads_, 0.0);
}

void Model::init(uint64_t seed) {
  reset_buffers();
  if (storage_ != Storage::flat) fail_usage("Model::init: external parameter storage is initialised by its strategy");
  for (size_t i = 0; i < params_.size(); ++i) init_param(i, seed, params_[i].value);
}

// Per parameter index i, Philox normal(0, std) under key seed at counter offset i << 40; norm
// weights 1, biases 0; attention.wo and feed_forward.w2 with std / sqrt(2 * depth), depth the
// llama's layers or the mlp's linear layers.
void Model::init_param(size_t index, uint64_t seed, Tensor& out) const {
  constexpr double kStd = 0.02;
  const Param& p = params_.at(index);
  if (out.shape() != p.shape) fail("init_param: " + p.name + " is " + shape_str(p.shape) + ", not " + out.str());
  const int64_t depth = config_.arch == Arch::llama ? config_.n_layers : static_cast<int64_t>(config_.hidden.size()) + 1;
  if (p.init == Init::normal) {
    ops::normal_(out, seed, static_cast<uint64_t>(index) << 40, 0.0, p.init_std);
  } else if (p.init == Init::ones || p.init == Init::zeros) {
    ops::fill(out, p.init == Init::ones ? 1.0 : 0.0);
  } else if (p.name.ends_with("norm.weight")) {
    ops::fill(out, 1.0);
  } else if (p.name.ends_with(".bias")) {
    ops::fill(out, 0.0);
  } else {
    double std = kStd;
    if (p.name.ends_with("attention.wo.weight") || p.name.ends_with("feed_forward.w2.weight"))
      std /= std::sqrt(2.0 * static_cast<double>(std::max<int64_t>(depth, 1)));
    ops::normal_(out, seed, static_cast<uint64_t>(index) << 40, 0.0, std);
  }
}

// ---------------------------------------------------------------------------- the driver

namespace {
// The GEMM arithmetic of a precision (f64 models always exact; a bf16 operand ignores it).
ops::Math math_of(Precision p, DType t) {
  if (t != DType::f32 || p == Precision::f32) return ops::Math::exact;
  return p == Precision::tf32 ? ops::Math::tf32 : ops::Math::bf16;
}
}  // namespace

void Model::set_precision(Precision p) {
  if (p == Precision::bf16 && dtype_ != DType::f32)
    fail_usage("precision bf16 needs an f32 model, this one is " + std::string(dtype_name(dtype_)));
  precision_ = p;
}

void Model::prepare_halves(Precision p) {
  if (storage_ != Storage::flat) return;
  if (!uses_bf16_weights(p)) {
    if (halves_.defined() && !pending_) {
      halves_ = Tensor();
      for (Param& q : params_) q.half = Tensor();
    }
    return;
  }
  if (!halves_.defined()) {
    halves_ = Tensor::empty({values_.numel()}, DType::bf16, device_);
    int64_t off = 0;
    for (Param& q : params_) {
      const int64_t n = shape_numel(q.shape);
      q.half = halves_.slice(off, off + n).reshape(q.shape);
      off += n;
    }
  }
  ops::cast(values_, halves_);  // one pass over the flat buffer (the values may have changed since)
}

void Model::forward(const Batch& batch, Tensor& acc, double weight) {
  if (!acc.defined() || acc.dtype() != DType::f64 || acc.numel() != 1 || acc.device() != device_)
    fail_usage("{}: the loss accumulator must be f64 [1] on {}, got {}", name_of(config_.arch), device_.str(),
               acc.defined() ? acc.str() : "none");
  train_forward(batch, &acc, weight);
}

double Model::forward(const Batch& batch) { return train_forward(batch, nullptr, 1); }

double Model::train_forward(const Batch& batch, Tensor* acc, double weight) {
  LossScope sink({acc, weight, batch.host_targets});
  pending_ = false;
  const Checkpointing mode = checkpointing_;
  running_precision_ = precision_;
  prepare_halves(precision_);
  ComputeScope compute(math_of(precision_, dtype_), uses_bf16_weights(precision_));
  begin(batch, Pass::train, mode);
  const double loss = run_forward(Pass::train, mode);
  pending_ = true;
  pending_mode_ = mode;
  pending_precision_ = precision_;
  return loss;
}

double Model::evaluate(const Batch& batch) {
  LossScope sink({nullptr, 1, batch.host_targets});
  running_precision_ = precision_;
  prepare_halves(precision_);
  ComputeScope compute(math_of(precision_, dtype_), uses_bf16_weights(precision_));
  begin(batch, Pass::evaluate, Checkpointing::none);
  const double loss = run_forward(Pass::evaluate, Checkpointing::none);
  running_precision_ = pending_precision_;
  return loss;
}

double Model::run_forward(Pass pass, Checkpointing mode) {
  if (block_fns_.size() != block_params_.size())
    fail("{}: {} blocks listed for {} blocks of parameters", name_of(config_.arch), block_fns_.size(), block_params_.size());
  BlockHooks& hk = hooks();
  double loss = 0;
  for (size_t b = 0; b < block_fns_.size(); ++b) {
    hk.before_forward(static_cast<int>(b), pass);
    loss = block_fns_[b].forward(pass, mode);
    hk.after_forward(static_cast<int>(b), pass);
  }
  return loss;
}

void Model::backward(double scale) {
  if (!pending_) fail(std::string(name_of(config_.arch)) + " backward: no forward to differentiate (each backward needs its own forward)");
  pending_ = false;
  running_precision_ = pending_precision_;
  ComputeScope compute(math_of(pending_precision_, dtype_), uses_bf16_weights(pending_precision_));
  BlockHooks& hk = hooks();
  for (size_t i = block_fns_.size(); i-- > 0;) {
    const Block& blk = block_fns_[i];
    const int b = static_cast<int>(i);
    hk.before_backward(b);
    if (blk.recompute && pending_mode_ != Checkpointing::none) {
      hk.before_forward(b, Pass::recompute);
      blk.recompute(pending_mode_);
      hk.after_forward(b, Pass::recompute);
    }
    blk.backward(pending_mode_, scale);
    hk.after_backward(b);
  }
}

// ---------------------------------------------------------------------------- parameters

void Model::build_params(const std::vector<std::tuple<std::string, Shape, int>>& specs) {
  params_.clear();
  block_params_.clear();
  int64_t total = 0;
  int max_block = -1;
  std::set<std::string> names;
  for (const auto& [name, shape, block] : specs) {
    if (!names.insert(name).second) fail("build_params: duplicate parameter name " + name);
    if (block < 0) fail("build_params: negative block for " + name);
    total += shape_numel(shape);
    max_block = std::max(max_block, block);
  }
  if (storage_ == Storage::flat) {
    values_ = Tensor::zeros({total}, dtype_, device_);
    grads_ = Tensor::zeros({total}, dtype_, device_);
  }
  block_params_.resize(static_cast<size_t>(max_block + 1));
  params_.reserve(specs.size());
  int64_t off = 0;
  for (const auto& [name, shape, block] : specs) {
    const int64_t n = shape_numel(shape);
    Param p;
    p.name = name;
    if (storage_ == Storage::flat) {
      p.value = values_.slice(off, off + n).reshape(shape);
      p.grad = grads_.slice(off, off + n).reshape(shape);
    }
    p.block = block;
    p.shape = shape;
    block_params_[static_cast<size_t>(block)].push_back(static_cast<int>(params_.size()));
    params_.push_back(std::move(p));
    off += n;
  }
}

void Model::build_buffers(const std::vector<std::pair<std::string, Shape>>& specs) {
  int64_t total = 0;
  for (const auto& [name, shape] : specs) total += shape_numel(shape);
  buffers_.clear();
  buffer_values_ = specs.empty() ? Tensor() : Tensor::zeros({total}, dtype_, device_);
  int64_t off = 0;
  for (const auto& [name, shape] : specs) {
    const int64_t n = shape_numel(shape);
    buffers_.push_back({name, buffer_values_.slice(off, off + n).reshape(shape)});
    off += n;
  }
  reset_buffers();
}

void Model::reset_buffers() {
  for (NamedTensor& b : buffers_) ops::fill(b.value, b.name.ends_with("running_var") ? 1.0 : 0.0);
}

std::unique_ptr<Model> make_model(const ModelConfig& cfg, Device d, DType dtype, Storage storage) {
  cfg.validate();
  if (dtype != DType::f32 && dtype != DType::f64)
    fail_usage("make_model: the model dtype must be f32 or f64, got " + std::string(dtype_name(dtype)));
  if (cfg.arch == Arch::llama) return detail::make_llama(cfg, d, dtype, storage);
  if (cfg.arch == Arch::resnet) return detail::make_resnet(cfg, d, dtype, storage);
  return detail::make_mlp(cfg, d, dtype, storage);
}

}  // namespace dtk::nn
