#include "dtk/train/strategy.h"

#include "dtk/core/error.h"
#include "dtk/optim/shampoo.h"
#include "dtk/parallel/data_parallel.h"

namespace dtk::train {

optim::ShampooConfig shampoo_config(const Options& o, const optim::ShampooConfig& shampoo) {
  optim::ShampooConfig c = shampoo;
  c.beta1 = o.optimization.beta1;
  c.beta2 = o.optimization.beta2;
  c.weight_decay = o.optimization.weight_decay;
  c.nesterov = o.optimization.nesterov;
  c.momentum = o.optimization.momentum.value_or(o.optimization.nesterov ? 0.9 : 0.0);
  return c;
}

Strategy strategy(std::string program, const Options& o, int optimizer_ranks, const optim::ShampooConfig& shampoo) {
  Strategy s;
  s.program = std::move(program);
  const size_t bucket_bytes = o.runtime.bucket_bytes;
  s.parallelism = [bucket_bytes](nn::Model& model, comm::Communicator& world, comm::Communicator&) {
    return std::make_unique<parallel::GradSync>(model, world, bucket_bytes);
  };
  if (o.optimization.optimizer == optim::Kind::shampoo) {
    const optim::ShampooConfig c = shampoo_config(o, shampoo);
    c.validate();
    // Dion's factors aggregate its matrices' gradients: the all-reduce leaves them out, and so do
    // --clip and grad_norm (their mean gradient is never formed).
    s.parallelism = [bucket_bytes, c](nn::Model& model, comm::Communicator& world, comm::Communicator&) {
      return std::make_unique<parallel::GradSync>(model, world, bucket_bytes, optim::dion_local_gradients(c, model.params()));
    };
    if (c.trainers_per_group > 0 && optimizer_ranks % c.trainers_per_group != 0)
      fail_usage("--trainers-per-group {} does not divide the {} ranks that share Shampoo's blocks",
                 c.trainers_per_group, optimizer_ranks);
    s.optimizer_config = c;
    // Shampoo splits its blocks over the ranks that hold the same parameters (collective over them).
    s.optimizer = [c](parallel::Parallelism& p) {
      return optim::make_shampoo(c, p.params(), p.optimizer_comm(), p.param_rows(), p.replica_comm());
    };
    return s;
  }
  optim::OptimConfig oc;
  oc.name = o.optimization.optimizer;
  if (o.optimization.momentum) oc.momentum = *o.optimization.momentum;
  oc.nesterov = o.optimization.nesterov;
  oc.beta1 = o.optimization.beta1;
  oc.beta2 = o.optimization.beta2;
  oc.eps = o.optimization.eps;
  oc.weight_decay = o.optimization.weight_decay;
  s.optimizer_config = oc;
  s.optimizer = [oc](parallel::Parallelism& p) { return optim::make_optimizer(oc, p.params(), p.param_rows()); };
  return s;
}

Strategy strategy(std::string program, const Options& o, int optimizer_ranks) {
  return strategy(std::move(program), o, optimizer_ranks, optim::ShampooConfig{});
}

}  // namespace dtk::train
