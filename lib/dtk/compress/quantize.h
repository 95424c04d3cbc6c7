// dtk::compress — the mean over ranks of a flat f32 vector, sent in a narrow format: how
// psgd-train's --sync diloco|streaming exchanges its pseudo-gradients (--outer-dtype).
//
// Formats (Wire), each element of x rounded to nearest (ties to even for bf16, away from zero for
// the others), deterministically:
//   f32   as it is: one all-reduce (sum), then / W. Sent: n * 4.
//   bf16  bf16 (8 exponent bits, 7 mantissa bits). Sent: n * 2.
//   int8  per block of kQuantBlock elements a scale s = max |x| (f32); code round(127 x / s) in
//         [-127, 127]. Sent: n + 4 n / kQuantBlock.
//   e3m0  Streaming DiLoCo's 4-bit float: a sign and 3 exponent bits, no mantissa; per block the
//         scale s = max |x|; code 0 is zero, code c in 1..7 is s 2^(c - 7), so that the block's
//         largest element is exact and the smallest non-zero magnitude is s / 64; |x| below
//         s / 128 rounds to zero. Sent: n / 2 + 4 n / kQuantBlock.
// The narrow formats (everything but f32) travel as torchft's quantized all-reduce does: each
// rank quantizes its x, an all-to-all gives rank j chunk j of every rank, rank j dequantizes them,
// sums in f32 in rank order and divides by W, quantizes that mean chunk again, and an all-gather
// gives every rank every mean chunk, which it dequantizes. Every rank ends with the same bits,
// and each element crosses the wire twice as in a ring all-reduce (2 (W - 1) / W of the payload).
// Error feedback (error non-null, narrow formats): the rank sends x + error and keeps in error
// what its quantization lost of it; the owner of a chunk also adds W times what quantizing the
// mean chunk lost, so that the mean over ranks of the buffers holds both roundings and the next
// exchange sends them. Without it e3m0 loses every element below s / 128 of its block, every
// time: a systematic bias that grows with H (more inner steps, larger outliers).
// "Sent" counts payload put into collectives (as compress/compressor.h's Bytes do).
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "dtk/comm/comm.h"
#include "dtk/core/enums.h"

namespace dtk::compress {

enum class Wire { f32, bf16, int8, e3m0 };
DTK_ENUM_NAMES(Wire, {Wire::f32, "f32"}, {Wire::bf16, "bf16"}, {Wire::int8, "int8"}, {Wire::e3m0, "e3m0"})

inline constexpr int64_t kQuantBlock = 128;

// Payload bytes of n elements in the format (scales included; n a multiple of kQuantBlock or not).
int64_t wire_bytes(Wire w, int64_t n);
// Quantizes x[0, n) into out (wire_bytes(w, n) bytes: the scales first, then the codes), and,
// with err non-null, writes x - dequantize(quantize(x)) there. Not for f32.
void quantize(Wire w, const float* x, int64_t n, uint8_t* out, float* err = nullptr);
// The values in[0, wire_bytes(w, n)) stand for, into x[0, n).
void dequantize(Wire w, const uint8_t* in, int64_t n, float* x);

// One exchange at a time over comm (host buffers): start, then progress() until it returns true
// or finish(). Collective: every rank calls start with the same n, in the same order.
class QuantizedMean {
 public:
  QuantizedMean(comm::Communicator& comm, Wire wire);
  // An exchange still in flight (a run that ends between a fragment's send and its application)
  // is waited for: its collective writes into this object's buffers, and dropping an MPI Work
  // does not wait (comm.h). While an exception unwinds (a peer may be gone) the buffers are left
  // to the collective instead.
  ~QuantizedMean();
  QuantizedMean(const QuantizedMean&) = delete;
  QuantizedMean& operator=(const QuantizedMean&) = delete;
  // x[0, n) is read at once (x + error sent; error updated in place when non-null).
  void start(const float* x, float* error, int64_t n);
  // Advances the exchange without waiting: the all-to-all's completion starts the all-gather.
  // True once complete (or when none is in flight).
  bool progress();
  // Waits for it and writes the mean, the same on every rank, into mean[0, n).
  void finish(float* mean);
  bool in_flight() const { return stage_ != Stage::idle; }
  int64_t bytes() const { return bytes_; }  // of the last exchange started

 private:
  enum class Stage { idle, first, second, done };
  void reduce_own_chunk();
  comm::Communicator& comm_;
  Wire wire_;
  Stage stage_ = Stage::idle;
  int64_t n_ = 0, chunk_ = 0, bytes_ = 0;  // chunk_: elements per rank's chunk (whole blocks)
  float* error_ = nullptr;
  std::vector<float> f32_;       // f32: the sum in flight
  std::vector<uint8_t> send_, recv_, gathered_;
  comm::Work work_;
};

}  // namespace dtk::compress
