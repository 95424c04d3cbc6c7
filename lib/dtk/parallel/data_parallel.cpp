#include "dtk/parallel/data_parallel.h"

#include <xxhash.h>

#include <algorithm>
#include <cstdio>

#include "dtk/core/error.h"
#include "dtk/optim/optimizer.h"

namespace dtk::parallel {

namespace {

// XXH3 over the tensor's bytes (on the host), folded to 53 bits so it travels exactly as a double.
uint64_t checksum(const Tensor& t) {
  const Tensor h = t.is_cuda() ? t.to(Device::cpu()) : t;
  return XXH3_64bits(h.data(), h.bytes()) & ((1ull << 53) - 1);
}

// The parameters but those marked local.
std::vector<nn::Param> without_local(const std::vector<nn::Param>& params, const std::vector<char>& local) {
  std::vector<nn::Param> out;
  for (size_t i = 0; i < params.size(); ++i)
    if (i >= local.size() || !local[i]) out.push_back(params[i]);
  return out;
}

// The plain bucketed all-reduce: the `none` compressor.
std::unique_ptr<compress::Compressor> plain(const std::vector<nn::Param>& params, comm::Communicator& comm,
                                            size_t bucket_bytes) {
  compress::Config c;
  c.kind = compress::Kind::none;
  return compress::make_compressor(c, comm, params, bucket_bytes);
}

}  // namespace

void check_replicated(const Tensor& t, comm::Communicator& comm, const std::string& what) {
  if (comm.size() == 1) return;
  const double mine = static_cast<double>(checksum(t));
  const comm::Range r = comm::min_max_over_ranks(comm, {mine}, t.device())[0];
  if (r.min != r.max)
    fail("{} differ between ranks (checksums from {} to {}, this rank {})", what, static_cast<uint64_t>(r.min),
         static_cast<uint64_t>(r.max), static_cast<uint64_t>(mine));
}

void broadcast_params(nn::Model& model, comm::Communicator& comm) {
  if (comm.size() == 1) return;
  comm.broadcast(comm::buffer_of(model.values()), 0, comm::Mode::sync).wait();
  check_replicated(model.values(), comm, "the model's parameters");
}

GradSync::GradSync(nn::Model& model, comm::Communicator& comm, compress::Compressor& compressor)
    : model_(model), comm_(comm), c_(compressor), compressed_(true) {
  init();
}

GradSync::GradSync(nn::Model& model, comm::Communicator& comm, std::unique_ptr<compress::Compressor> compressor)
    : model_(model), comm_(comm), owned_(std::move(compressor)), c_(*owned_), compressed_(true) {
  init();
}

GradSync::GradSync(nn::Model& model, comm::Communicator& comm, size_t bucket_bytes, std::vector<char> local)
    : model_(model),
      comm_(comm),
      synced_(without_local(model.params(), local)),
      all_synced_(synced_.size() == model.params().size()),
      owned_(plain(synced_, comm, bucket_bytes)),
      c_(*owned_) {
  init();
}

std::vector<nn::Param>& GradSync::synced() { return all_synced_ ? model_.params() : synced_; }

void GradSync::init() {
  const auto& ps = synced();
  for (const compress::ParamRange& b : c_.buckets()) {
    int lo = 1 << 30;
    for (size_t i = b.first; i < b.last; ++i) lo = std::min(lo, ps[i].block);
    min_block_.push_back(lo);
  }
}

void GradSync::begin(int64_t step) {
  next_ = 0;
  c_.begin(synced(), step);
  armed_ = true;
}

void GradSync::after_backward(int block) {
  if (!armed_) return;
  while (next_ < min_block_.size() && min_block_[next_] >= block) c_.bucket_ready(next_++);
  c_.progress();
}

void GradSync::finish() {
  armed_ = false;
  c_.finish();
}

std::vector<PlacedTensor> GradSync::sync_state() {
  if (!compressed_) return {};
  return prefixed("compress/", c_.state());
}

void GradSync::clip_grad_norm(double max_norm, Tensor& norm) { optim::clip_grad_norm(synced(), max_norm, norm); }

void GradSync::metrics(nlohmann::ordered_json& m) const {
  const compress::Bytes b = c_.last_bytes();
  m["comm_bytes"] = b.sent;
  if (compressed_) {  // a compressor chosen by the program
    m["comm_bytes_uncompressed"] = b.uncompressed;
    m["compression_ratio"] = b.sent > 0 ? static_cast<double>(b.uncompressed) / static_cast<double>(b.sent) : 1.0;
    if (const nlohmann::json p = c_.plan(); !p.is_null()) m["compress_ranks"] = p["ranks"];
  }
}

}  // namespace dtk::parallel
