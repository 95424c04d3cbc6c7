// dtk::nn — models with explicit forward and backward (as in llm.c): each layer saves what its
// backward needs; there is no autograd tape. A model is a stack of blocks, the unit of
// gradient-ready notification (data-parallel overlap), FSDP scheduling and activation
// checkpointing.
//
// Parameters are addressable by name, in a fixed order (docs/DESIGN.md's order for llama). Where their
// values and gradients live is the parallelism's choice (Storage): flat, one buffer of values and
// one of gradients with a view per parameter, so a whole replicated model can be broadcast,
// checksummed or all-reduced as one tensor; or external, no storage at all: a sharded strategy
// (FSDP) points each Param's value and grad at its gathered block buffers while the block runs.
// Layers read Param::value and Param::grad at call time, so rebinding them between blocks is safe.
//
// The flat buffers are f32. make_model takes an optional dtype: DType::f64 builds the same model
// with f64 parameters, gradients and activations, for gradient checks against finite differences
// on the CPU (tests); the training programs always use f32.
//
// Contract for the training loop:
//  - forward(batch) then backward(scale), once each; backward needs a fresh forward
//    (an Error otherwise). evaluate() may run in between without disturbing the pending backward.
//  - forward keeps handles to the batch's tensors (token ids, targets, mlp inputs): leave their
//    contents unchanged until the backward (do not refill the same tensors with the next batch).
//  - backward accumulates: call zero_grad() (or zero grads() yourself) before a step's first
//    backward; several forward/backward pairs accumulate (gradient accumulation, with scale
//    1 / micro_batches for a mean).
//  - Activation buffers are allocated lazily for the batch shape and reused; a smaller batch
//    reuses the allocation, a larger one grows it. Nothing is allocated per step for a fixed shape.
//  - Batches must live on the model's device; llama inputs/targets i32 [B, T] with 1 <= T <= seq_len
//    and ids in [0, vocab) (targets may be -1: ignored); the loss is the mean over counted targets.
//  - llama blocks: 0 = tok_embeddings, 1..n_layers = layers.0..layers.{n_layers-1}, n_layers + 1
//    = norm + output. mlp: block i = layers.i. resnet: 0 = the stem (conv1, bn1), 1..n = the
//    residual blocks in order (layer1.0, layer1.1, ..., layer4.1), n + 1 = fc. Activation
//    checkpointing (Checkpointing) applies to the transformer layers and the residual blocks,
//    whose recomputation runs in backward; the mlp ignores it.
//  - Buffers (resnet: batch norm's running statistics) are state that is not trained: the model
//    owns them whatever the Storage, training forwards update them, evaluation reads them, and
//    checkpoints save them beside the parameters.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "dtk/core/enums.h"
#include "dtk/core/json_config.h"
#include "dtk/core/tensor.h"

namespace dtk::nn {

// How Model::init sets a parameter: by the name rules of Model::init (llama, mlp), or as the
// model chose when it built its parameters: normal(0, init_std), ones or zeros.
enum class Init { by_name, normal, ones, zeros };

// A trainable tensor. With flat storage value and grad are views into Model::values() and
// Model::grads(); with external storage they are whatever the strategy binds (undefined between
// blocks).
struct Param {
  std::string name;  // "layers.0.attention.wq.weight"
  Tensor value;      // f32; linear weights [out_features, in_features]
  Tensor grad;       // f32, same shape
  int block = 0;     // the block it belongs to
  Shape shape{};     // of value and grad, whatever the storage
  Init init = Init::by_name;
  double init_std = 0;  // Init::normal
  // The bf16 copy of value that the layers compute with under Precision::bf16 (Model::
  // uses_bf16_weights); undefined otherwise. Flat storage: a view into the model's bf16 copy of
  // values(), rewritten from the f32 values at the start of every forward and evaluation;
  // external: bound by the strategy (FSDP's bf16 gathers), and then value is not.
  Tensor half{};
};

// A model's buffer: state that is not trained (batch norm's running_mean and running_var),
// a view into Model::buffer_values().
struct NamedTensor {
  std::string name;  // "layer1.0.bn1.running_mean"
  Tensor value;
};

// Statistics shared by the ranks of SyncBatchNorm: f64 sums [2, C] (on the model's device) and
// the element count they were taken over, summed in place over the ranks.
using StatSync = std::function<void(Tensor& sums, double& count)>;

// Where a model's parameter values and gradients live (see above).
enum class Storage { flat, external };

// The architectures; a config's arch decides which of its fields apply.
enum class Arch { llama, mlp, resnet };
DTK_ENUM_NAMES(Arch, {Arch::llama, "llama"}, {Arch::mlp, "mlp"}, {Arch::resnet, "resnet"})

// The full model configuration; travels in every checkpoint (model_config) as JSON (arch as
// its name).
struct ModelConfig {
  Arch arch = Arch::llama;
  std::string preset;          // the preset it was built from (informational)
  // llama
  int64_t dim = 0, n_layers = 0, n_heads = 0, n_kv_heads = 0, ffn_hidden = 0, vocab = 0, seq_len = 0;
  double rope_theta = 10000.0, norm_eps = 1e-5;
  // mlp: input_dim -> hidden[0] -> ... -> classes, ReLU between
  int64_t input_dim = 0, classes = 0;
  std::vector<int64_t> hidden;
  // resnet (basic blocks, torchvision's layout): images input_shape = {C, H, W}; a stem (conv1,
  // bn1, ReLU; "cifar": 3x3 stride 1, "imagenet": 7x7 stride 2 then 3x3 max pooling stride 2),
  // stages i = 1..S of stage_blocks[i-1] residual blocks of stage_widths[i-1] channels (the
  // first block of every stage after the first with stride 2), global average pooling, fc to
  // `classes`. Batch norm's epsilon is norm_eps.
  std::vector<int64_t> input_shape, stage_widths, stage_blocks;
  std::string stem;

  void validate() const;  // sizes positive and consistent (UsageError naming the field)
  int64_t num_params() const;
  // Training FLOPs per token (llama) or per sample (mlp): 6 * matmul parameters + attention.
  double train_flops_per_item() const;
  int64_t head_dim() const { return n_heads > 0 ? dim / n_heads : 0; }
  bool classifier() const { return arch == Arch::mlp || arch == Arch::resnet; }
  // Values per sample of a classifier's input: input_dim (mlp), C H W (resnet); 0 for llama.
  int64_t sample_numel() const;

  bool operator==(const ModelConfig&) const = default;
};
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE_WITH_DEFAULT(ModelConfig, arch, preset, dim, n_layers, n_heads, n_kv_heads, ffn_hidden,
                                                vocab, seq_len, rope_theta, norm_eps, input_dim, classes, hidden,
                                                input_shape, stage_widths, stage_blocks, stem)

// A llama configuration of these sizes (no preset name).
ModelConfig llama_config(int64_t dim, int64_t layers, int64_t heads, int64_t kv_heads, int64_t ffn_hidden, int64_t vocab,
                         int64_t seq_len, double rope_theta = 10000.0);

// Sizes a user gives for a model (the programs' --dim, --layers, ...), each unset unless given.
struct SizeOptions {
  std::optional<int64_t> dim, layers, heads, kv_heads, ffn_hidden, vocab, seq_len, input_dim, classes;
  std::vector<int64_t> input_shape;  // resnet: C, H, W
};
// A preset with the sizes applied by its architecture's rules (llama: every size; mlp: --dim
// and --layers make the hidden layers, --input-dim, --classes; resnet: --input-shape and
// --classes). A UsageError names the options that do not apply to the preset.
ModelConfig with_sizes(ModelConfig preset_cfg, const SizeOptions& s);
// A checkpoint's config with sizes restated: a UsageError for one that contradicts it; only a
// llama's seq_len may change (RoPE has no trained length).
ModelConfig restated(ModelConfig ckpt_cfg, const SizeOptions& s);

// Named presets: llama-tiny (~1M params), llama-small (~25M), llama-1b, llama3-1b and llama3-8b
// (Llama 3.2 1B's and Llama 3 8B's shapes, vocabulary 128256, RoPE theta 500000; untied output,
// so llama3-1b has 1.50B parameters where Meta's tied model has 1.24B), mlp-small, mlp-mnist,
// resnet-8, resnet-20 (He et al.'s CIFAR ResNets, 78K and 272K parameters) and resnet-18 (the
// PowerSGD paper's CIFAR variant, 11.2M); the resnets take 3x32x32 images and 10 classes.
ModelConfig preset(const std::string& name);  // UsageError listing the presets when unknown
std::vector<std::string> preset_names();

// One batch on the model's device.
//   llama: inputs i32 [B, T] token ids, targets i32 [B, T] (the next tokens)
//   mlp:   inputs f32 [B, input_dim], targets i32 [B] (class ids)
//   resnet: inputs f32 [B, C, H, W] (or [B, C H W]), targets i32 [B] (class ids)
// host_inputs and host_targets: the host's copies of a batch on a GPU, which the model checks
// (token ids in range) and counts (targets not ignored) instead of reading the device's back;
// undefined on the host, or when the batch was made on the device (the model then copies back).
struct Batch {
  Tensor inputs, targets;
  Tensor host_inputs{}, host_targets{};
  int64_t samples() const { return inputs.defined() ? inputs.dim(0) : 0; }
  // On device d (a GPU: the host's tensors kept as the copies).
  Batch to(Device d) const {
    if (!d.is_cuda() || inputs.is_cuda()) return {inputs.to(d), targets.to(d)};
    return {inputs.to(d), targets.to(d), inputs, targets};
  }
};

// What runs a block's forward: training, evaluation, or the recomputation of activation
// checkpointing (inside that block's backward hooks).
enum class Pass { train, evaluate, recompute };

// Activation checkpointing of the transformer layers: what each layer keeps from its forward for
// its backward, and what its backward recomputes first. Gradients are bit-identical in every mode
// (the recomputation runs the same ops on the same inputs).
//   none       every layer keeps all its activations: the most memory, no recomputation.
//   full       a layer keeps only its input (the residual stream); backward reruns its forward.
//   selective  a layer keeps the outputs of its matmuls and of attention (q, k, v, the attention
//              output and its log-sum-exp, w1 x and w3 x); backward recomputes the cheap rest
//              (the norms, the residual add, silu(w1 x) * w3 x) and the wo projection, as
//              torchtitan's selective activation checkpointing: less memory than none, more than
//              full, for a fraction of full's recomputation.
enum class Checkpointing { none, full, selective };
// The arithmetic of a model (--precision; Model::set_precision).
enum class Precision { f32, tf32, bf16 };
DTK_ENUM_NAMES(Precision, {Precision::f32, "f32"}, {Precision::tf32, "tf32"}, {Precision::bf16, "bf16"})
DTK_ENUM_NAMES(Checkpointing, {Checkpointing::none, "none"}, {Checkpointing::full, "full"},
               {Checkpointing::selective, "selective"})

// The seam between a model and parallelism (docs/DESIGN.md, "The model/parallelism seam"): a
// strategy's calls at block boundaries, made by the model's driver (Model::forward, backward,
// evaluate). Blocks run forward in increasing index order (the embedding, the layers, the
// head), backward in decreasing order: before_backward(b), with activation checkpointing (full
// or selective) before_forward(b, recompute) and after_forward(b, recompute), the block's
// backward, then after_backward(b), when the block's gradients are final. Evaluation calls the
// forward hooks with Pass::evaluate. Defaults do nothing.
class BlockHooks {
 public:
  virtual ~BlockHooks() = default;
  virtual void before_forward(int block, Pass pass) {
    (void)block;
    (void)pass;
  }
  virtual void after_forward(int block, Pass pass) {
    (void)block;
    (void)pass;
  }
  virtual void before_backward(int block) { (void)block; }
  virtual void after_backward(int block) { (void)block; }
};

// One block of a model, as the driver (Model::forward, backward, evaluate) runs it between the
// strategy's hooks. A model lists its blocks in order (add_block); they pass activations to one
// another through the model's own buffers, so each is three functions of the model's state.
struct Block {
  // Training (Pass::train, keeping what checkpointing mode `mode` keeps) or evaluation
  // (Pass::evaluate, mode none: objects and buffers that leave a pending backward intact). The
  // last block, the head, returns the mean loss; the others return 0.
  std::function<double(Pass pass, Checkpointing mode)> forward;
  // Empty: activation checkpointing does not apply to the block. Else, before its backward in
  // modes full and selective (between the hooks' before_forward and after_forward with
  // Pass::recompute): what its forward did not keep.
  std::function<void(Checkpointing mode)> recompute;
  // Parameter gradients += d(scale * loss)/d(params); the gradient of the block's input passed
  // to the block before it. The head starts from scale.
  std::function<void(Checkpointing mode, double scale)> backward;
};

class Model {
 public:
  virtual ~Model() = default;
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  const ModelConfig& config() const { return config_; }
  Device device() const { return device_; }
  DType dtype() const { return dtype_; }  // of values, grads and activations: f32 (f64 for tests)
  std::vector<Param>& params() { return params_; }
  const std::vector<Param>& params() const { return params_; }
  Param& param(const std::string& name);  // UsageError naming it when absent
  Storage storage() const { return storage_; }
  // Flat storage: f32 [num_params], every Param::value (grad) a view into it; external: undefined.
  Tensor& values() { return values_; }
  Tensor& grads() { return grads_; }
  int num_blocks() const { return static_cast<int>(block_params_.size()); }
  const std::vector<int>& block_params(int b) const { return block_params_.at(static_cast<size_t>(b)); }

  // Philox normal(0, 0.02) per parameter, each parameter its own stream (seed, parameter index:
  // ops::normal_ with key seed and counter offset index << 40),
  // output projections (attention.wo, feed_forward.w2) scaled by 1/sqrt(2 * n_layers), norm
  // weights 1, biases 0, unless the model chose otherwise (Param::init: the resnet's); buffers
  // to their initial values: identical for a seed on any device and any world size.
  // Flat storage only (a UsageError otherwise); init_param gives one parameter's initial value
  // (out: its shape, the model's dtype, any device), which is how a sharded strategy initialises
  // its shards.
  void init(uint64_t seed);
  void init_param(size_t index, uint64_t seed, Tensor& out) const;
  // The driver. Mean loss over the batch's targets; saves the activations backward needs (in
  // the activation checkpointing mode set now): each block's forward, in order, between the
  // hooks' before_forward and after_forward (Pass::train).
  double forward(const Batch& batch);
  // The same forward with the loss left on the device: acc (f64 [1] on the model's device) +=
  // weight * the mean loss, so that the host does not wait for the GPU to read it (the trainer
  // reads the step's sum once).
  void forward(const Batch& batch, Tensor& acc, double weight);
  // grads += scale * d(loss of the last forward)/d(params): each block in reverse order, between
  // the hooks' before_backward and after_backward, its recomputation first (see Block).
  void backward(double scale);
  // Forward only, no activations kept for backward: the mean loss (evaluation; Pass::evaluate).
  double evaluate(const Batch& batch);
  // Classifiers (mlp, resnet): how many samples of the last forward or evaluate had their target as the
  // largest logit (top-1 accuracy times the batch size). -1: not a classifier (llama).
  virtual int64_t correct() const { return -1; }
  void zero_grad();  // flat storage: zeroes grads(); external: nothing (the strategy's job)
  // The buffers in order, each a view into buffer_values() (the model's dtype and device; one
  // tensor, so that ranks can broadcast them at once; undefined when there are none).
  std::vector<NamedTensor>& buffers() { return buffers_; }
  Tensor& buffer_values() { return buffer_values_; }
  // Batch norm's statistics over the ranks that share them (SyncBatchNorm) from the next forward
  // on; null: this rank's batch alone (the default, as DDP). Models without batch norm ignore it.
  virtual void set_batchnorm_sync(StatSync sync) { (void)sync; }
  // Activation checkpointing (see Checkpointing) from the next forward on; a pending backward
  // keeps the mode of its forward.
  void set_activation_checkpointing(Checkpointing c) { checkpointing_ = c; }
  Checkpointing activation_checkpointing() const { return checkpointing_; }
  // The model's arithmetic from the next forward on (a pending backward keeps its forward's).
  // Parameters, gradients and optimizer state stay f32 in every precision.
  //   f32   true f32 products (f64 models, the gradient checks, always compute in f64).
  //   tf32  the weight GEMMs on tensor cores with the operands rounded to TF32 (ops::Math::tf32);
  //         activations f32.
  //   bf16  mixed precision, as PyTorch's autocast with FSDP2's bf16 parameters: the layers read
  //         the bf16 copy of every parameter (Param::half), GEMMs and attention take bf16
  //         operands and accumulate in f32; llama keeps its activations in bf16 (norm outputs,
  //         q, k, v, attention, the feed-forward's, the logits) and the residual stream, the
  //         norms' statistics, softmax and the loss in f32; the gradients into the norms and the
  //         residual stream are f32, those between GEMMs bf16; weight gradients accumulate in f32
  //         (ops.h's mixed-precision ops). The mlp keeps f32 activations, cast to bf16 at each
  //         Linear. resnet (uses_bf16_weights false) keeps f32 weights and activations and rounds
  //         the operands of its convolutions and fc to bf16 (ops::Math::bf16).
  //         Needs an f32 model (a UsageError otherwise).
  void set_precision(Precision p);
  Precision precision() const { return precision_; }
  // Whether the layers read bf16 copies of the weights (Param::half) in precision p: bf16, for
  // the models whose layers run in bf16 (llama, mlp). A sharded strategy binds Param::half then.
  bool uses_bf16_weights(Precision p) const { return p == Precision::bf16 && bf16_layers(); }
  // The strategy's block hooks (not owned; null: none).
  void set_hooks(BlockHooks* hooks) { hooks_ = hooks; }

 protected:
  Model(ModelConfig cfg, Device d, DType t, Storage s) : config_(std::move(cfg)), device_(d), dtype_(t), storage_(s) {}
  // The model's part of a pass, before its blocks run: checks the batch, keeps it for the
  // blocks and sizes their buffers (for training, laid out for checkpointing mode `mode`).
  virtual void begin(const Batch& batch, Pass pass, Checkpointing mode) = 0;
  // Appends the next block (blocks are numbered in the order they are added, as their
  // parameters are by build_params).
  void add_block(Block b) { block_fns_.push_back(std::move(b)); }
  // Whether a training forward awaits its backward (evaluation then uses objects of its own).
  bool backward_pending() const { return pending_; }
  // Whether the layers run in bf16 under Precision::bf16 (see set_precision); resnet's do not.
  virtual bool bf16_layers() const { return true; }
  // The dtype of the activations the running pass computes in: bf16 for llama under
  // Precision::bf16, else the model's dtype.
  DType act_dtype() const {
    return config_.arch == Arch::llama && uses_bf16_weights(running_precision_) ? DType::bf16 : dtype_;
  }

  // Registers the parameters (name, shape, block) in order, then allocates the flat buffers
  // (flat storage).
  void build_params(const std::vector<std::tuple<std::string, Shape, int>>& specs);
  // Registers the buffers (name, shape) in order and allocates them at their initial values
  // (reset_buffers).
  void build_buffers(const std::vector<std::pair<std::string, Shape>>& specs);
  // Every buffer to its initial value: running_var ones, the rest zeros.
  void reset_buffers();

  ModelConfig config_;
  Device device_;
  DType dtype_ = DType::f32;
  Storage storage_ = Storage::flat;
  std::vector<Param> params_;
  std::vector<std::vector<int>> block_params_;  // the parameters' indices, per block
  Tensor values_, grads_;
  std::vector<NamedTensor> buffers_;
  Tensor buffer_values_;
  Checkpointing checkpointing_ = Checkpointing::none;
  Precision precision_ = Precision::f32;
  // The hooks to call (a no-op set when none are given).
  BlockHooks& hooks() {
    static BlockHooks none;
    return hooks_ ? *hooks_ : none;
  }

 private:
  // Both forms of forward: the loss to acc (weight times the mean) or, without acc, returned.
  double train_forward(const Batch& batch, Tensor* acc, double weight);
  // The blocks' forwards in order between the hooks; the head's loss.
  double run_forward(Pass pass, Checkpointing mode);

  BlockHooks* hooks_ = nullptr;
  std::vector<Block> block_fns_;
  // Flat storage: the bf16 copy of the values for a pass in precision p (written from values(),
  // or released when p does not use it and no backward is pending).
  void prepare_halves(Precision p);

  Tensor halves_;                                     // flat storage, bf16 weights: the copy
  Precision running_precision_ = Precision::f32;      // of the pass that runs now
  bool pending_ = false;                              // a training forward awaits its backward
  Checkpointing pending_mode_ = Checkpointing::none;  // ... in this mode
  Precision pending_precision_ = Precision::f32;      // ... and this precision
};

// Validates cfg (UsageError naming the field). dtype: f32 (training) or f64 (gradient checks).
std::unique_ptr<Model> make_model(const ModelConfig& cfg, Device d, DType dtype = DType::f32,
                                  Storage storage = Storage::flat);

}  // namespace dtk::nn
