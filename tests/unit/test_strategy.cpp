// train::strategy(): the replicated strategy of the options that every *-train program starts
// from, its optimizer placed over what the parallelism holds, and Shampoo's options resolved and
// checked once.
#include <gtest/gtest.h>

#include "dtk/comm/comm.h"
#include "dtk/core/error.h"
#include "dtk/optim/shampoo.h"
#include "dtk/train/strategy.h"

namespace dtk::train {
namespace {

TEST(Strategy, ReplicatedWithTheOptionsOptimizer) {
  Options o;
  o.optimization.optimizer = optim::Kind::sgd;
  o.optimization.momentum = 0.5;
  Strategy s = strategy("test", o, 1);
  EXPECT_EQ(s.program, "test");
  EXPECT_EQ(s.storage, nn::Storage::flat);
  auto model = nn::make_model(nn::preset("mlp-small"), Device::cpu());
  auto world = comm::make_local_communicator();
  auto par = s.parallelism(*model, *world, *world);
  EXPECT_TRUE(par->sync_state().empty());  // the plain all-reduce keeps no state
  for (const PlacedTensor& t : par->state()) {
    EXPECT_EQ(t.name.rfind("model/", 0), 0u) << t.name;
    EXPECT_EQ(t.placement, Placement::replicated) << t.name;
  }
  auto opt = s.optimizer(*par);
  EXPECT_EQ(opt->config().at("name"), "sgd");
  EXPECT_EQ(opt->config().at("momentum"), 0.5);
  EXPECT_EQ(opt->state().size(), model->params().size() + 1);  // momentum per parameter, the step
}

TEST(Strategy, ShampooTakesTheCommonOptionsAndIsCheckedOnce) {
  Options o;
  o.optimization.optimizer = optim::Kind::shampoo;
  o.optimization.beta1 = 0.7;
  o.optimization.nesterov = true;
  optim::ShampooConfig c;
  c.precondition_frequency = 7;
  const optim::ShampooConfig r = shampoo_config(o, c);
  EXPECT_EQ(r.precondition_frequency, 7);
  EXPECT_EQ(r.beta1, 0.7);
  EXPECT_EQ(r.momentum, 0.9);  // --nesterov without --momentum
  Strategy s = strategy("test", o, 2, c);
  auto model = nn::make_model(nn::preset("mlp-small"), Device::cpu());
  auto world = comm::make_local_communicator();
  auto par = s.parallelism(*model, *world, *world);
  EXPECT_EQ(s.optimizer(*par)->config().at("precondition_frequency"), 7);
  EXPECT_EQ(s.optimizer_config, nlohmann::json(r));  // what a program records of it

  c.trainers_per_group = 3;
  EXPECT_THROW(strategy("test", o, 4, c), UsageError);  // 3 does not divide 4
  c.trainers_per_group = 0;
  c.epsilon = -1;
  EXPECT_THROW(strategy("test", o, 4, c), UsageError);
  o.optimization.optimizer = optim::Kind::adamw;  // Shampoo's options are not Shampoo's business then
  EXPECT_NO_THROW(strategy("test", o, 4, c));
}

}  // namespace
}  // namespace dtk::train
