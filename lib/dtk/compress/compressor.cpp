// Config and the factory of the compressors (the kinds: allreduce.cpp, powersgd.cpp, baselines.cpp).
#include <cmath>
#include <string>

#include "dtk/compress/internal.h"
#include "dtk/core/error.h"

namespace dtk::compress {

void Config::validate() const {
  if (rank < 1) fail_usage("compressor: rank must be >= 1, got {}", rank);
  if (start_iter < 0) fail_usage("compressor: start_iter must be >= 0, got {}", start_iter);
  if (!(min_compression_rate >= 0) || !std::isfinite(min_compression_rate))
    fail_usage("compressor: min_compression_rate must be finite and >= 0, got {}", min_compression_rate);
  if (comm_dtype != DType::f32 && comm_dtype != DType::bf16)
    fail_usage("compressor: comm_dtype must be f32 or bf16, got " + std::string(dtype_name(comm_dtype)));
  if (!(ratio > 0 && ratio <= 1)) fail_usage("compressor: ratio must be in (0, 1], got {}", ratio);
  if (auto_ranks.size() != 2 || auto_ranks[0] < 1 || auto_ranks[1] < auto_ranks[0])
    fail_usage("compressor: auto_ranks must be two ranks LOW,HIGH with 1 <= LOW <= HIGH, got {} value(s)",
               auto_ranks.size());
  if (!(accordion_eta > 0) || !std::isfinite(accordion_eta))
    fail_usage("compressor: accordion_eta must be finite and > 0, got {}", accordion_eta);
  if (auto_interval < 1) fail_usage("compressor: auto_interval must be >= 1, got {}", auto_interval);
  if (auto_refresh < 0) fail_usage("compressor: auto_refresh must be >= 0, got {}", auto_refresh);
}

std::unique_ptr<Compressor> make_compressor(const Config& cfg, comm::Communicator& comm,
                                            const std::vector<nn::Param>& params, size_t bucket_bytes, const Topology& topology) {
  cfg.validate();
  if (bucket_bytes == 0) fail_usage("the gradient bucket size must be positive");
  switch (cfg.kind) {
    case Kind::none: return detail::make_none(cfg, comm, params, bucket_bytes, topology);
    case Kind::powersgd: return detail::make_powersgd(cfg, comm, params, bucket_bytes, topology);
    case Kind::topk: return detail::make_topk(cfg, comm, params, bucket_bytes, topology);
    case Kind::randomk: return detail::make_randomk(cfg, comm, params, bucket_bytes, topology);
    case Kind::signum: return detail::make_signum(cfg, comm, params, bucket_bytes, topology);
    case Kind::auto_: return detail::make_auto(cfg, comm, params, bucket_bytes, topology);
  }
  throw Error("unknown compressor kind");
}

}  // namespace dtk::compress
