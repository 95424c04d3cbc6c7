#include "dtk/parallel/parallelism.h"

namespace dtk::parallel {

std::vector<Rows> Parallelism::param_rows() {
  std::vector<Rows> r;
  for (size_t i = 0; i < params().size(); ++i) r.push_back(rows(i) ? *rows(i) : Rows{});
  return r;
}

std::pair<int, int> Parallelism::state_rank() {
  if (const Rows* r = sharded() ? rows(0) : nullptr) return {r->rank, static_cast<int>(r->offsets.size())};
  return {optimizer_comm().rank(), optimizer_comm().size()};
}

std::vector<PlacedTensor> Parallelism::model_state(nn::Model& model) {
  std::vector<PlacedTensor> s;
  std::vector<nn::Param>& ps = params();
  for (size_t i = 0; i < ps.size(); ++i) {
    s.push_back({"model/" + ps[i].name, ps[i].value});
    if (const Rows* r = rows(i)) s.back().placement = Placement::sharded, s.back().rows = *r;
  }
  for (nn::NamedTensor& b : model.buffers()) s.push_back({"model/" + b.name, b.value});
  return s;
}

}  // namespace dtk::parallel
