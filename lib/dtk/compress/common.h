// Internal to compress: what every compressor shares — the parameter layout, the plain
// all-reduce (kind "none" and the steps before start_iter), the once-per-run agreement check
// across ranks, the step counter and the byte accounting.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dtk/compress/compressor.h"

namespace dtk::compress::detail {

// Philox keys of the shared random streams, derived from Config::seed so that they differ from
// every other stream drawn from the same seed (model initialisation, data order).
uint64_t stream_key(uint64_t seed, uint64_t domain);
inline constexpr uint64_t kDomainQ = 0x5053474451494e49ull;       // Q initialisation and redraws
inline constexpr uint64_t kDomainQGuard = 0x505347445a45524full;  // Q columns redrawn after a zero
inline constexpr uint64_t kDomainRandomK = 0x52414e444f4d4bull;   // randomk coordinates

// The same on the host and the device: a stream-ordered copy (synchronous between host tensors).
void copy(Tensor& dst, const Tensor& src);

struct Layout {
  std::string name;
  Shape shape;
  int64_t numel = 0;
  int64_t offset = 0;  // in the flat concatenation of all grads, in parameter order
};

class Base : public Compressor {
 public:
  Base(const Config& cfg, comm::Communicator& comm, const std::vector<nn::Param>& params);

  void aggregate(std::vector<nn::Param>& params, int64_t step) final;
  Bytes last_bytes() const final { return bytes_; }
  std::vector<std::pair<std::string, Tensor>> state() override;
  bool per_rank(const std::string& state_name) const override;

 protected:
  // One compressed step (step >= start_iter); sets bytes_.sent.
  virtual void compressed_step(std::vector<nn::Param>& params, int64_t step, bool first) = 0;
  // Numbers that must agree on every rank (besides the layout): checked once, on the first call.
  virtual std::vector<double> agreement() { return {}; }
  // Plain all-reduce (sum) of every grad: one collective on the grads' own storage when they are
  // one contiguous run in parameter order, else packed into a flat buffer.
  void plain_all_reduce(std::vector<nn::Param>& params);
  // A per-rank error buffer for every parameter (views of one flat buffer), for the baselines.
  Tensor& flat_error();

  Config cfg_;
  comm::Communicator& comm_;
  Device device_;
  int world_ = 1;
  std::vector<Layout> layout_;
  int64_t total_ = 0;  // elements of all grads
  Bytes bytes_;
  Tensor step_;       // i64 [1] on the host: 1 + the last step aggregated (0 before the first)
  Tensor flat_;       // f32 [total_]: packed grads for plain_all_reduce (lazily)
  Tensor error_;      // f32 [total_]: per-rank error buffers of the baselines (when used)
  bool checked_ = false;

 private:
  void check_params(const std::vector<nn::Param>& params) const;
  void check_agreement();
};

std::unique_ptr<Compressor> make_none(const Config& cfg, comm::Communicator& comm, const std::vector<nn::Param>& params);
std::unique_ptr<Compressor> make_powersgd(const Config& cfg, comm::Communicator& comm,
                                          const std::vector<nn::Param>& params);
std::unique_ptr<Compressor> make_topk(const Config& cfg, comm::Communicator& comm, const std::vector<nn::Param>& params);
std::unique_ptr<Compressor> make_randomk(const Config& cfg, comm::Communicator& comm,
                                         const std::vector<nn::Param>& params);
std::unique_ptr<Compressor> make_signum(const Config& cfg, comm::Communicator& comm,
                                        const std::vector<nn::Param>& params);

// Elements kept per tensor by topk and randomk: ceil(ratio * numel), at least 1.
int64_t kept(double ratio, int64_t numel);

}  // namespace dtk::compress::detail
