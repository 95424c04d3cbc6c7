#include "dtk/compress/quantize.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <exception>

#include "dtk/core/error.h"
#include "dtk/core/half.h"

namespace dtk::compress {

namespace {

int64_t blocks(int64_t n) { return (n + kQuantBlock - 1) / kQuantBlock; }

int64_t code_bytes(Wire w, int64_t n) {
  switch (w) {
    case Wire::f32: return n * 4;
    case Wire::bf16: return n * 2;
    case Wire::int8: return n;
    case Wire::e3m0: return (n + 1) / 2;
  }
  return 0;
}

bool scaled(Wire w) { return w == Wire::int8 || w == Wire::e3m0; }

// e3m0: the code (1..7, 0 for zero) nearest to v = |x| / s in [0, 1] (ties away from zero).
uint8_t e3m0_code(float v) {
  if (!(v >= 0x1p-7f)) return 0;  // below half of the smallest level s / 64 (and NaN)
  if (v < 0x1p-6f) return 1;
  int e = 0;
  const float m = std::frexp(v, &e);  // v = m 2^e, m in [0.5, 1): between 2^(e-1) and 2^e
  const int c = (e - 1) + 7 + (m >= 0.75f ? 1 : 0);
  return static_cast<uint8_t>(std::min(c, 7));
}

float e3m0_value(uint8_t code, float s) {
  const uint8_t c = code & 7;
  if (c == 0) return 0.0f;
  const float v = std::ldexp(s, c - 7);
  return (code & 8) ? -v : v;
}

}  // namespace

int64_t wire_bytes(Wire w, int64_t n) { return code_bytes(w, n) + (scaled(w) ? 4 * blocks(n) : 0); }

void quantize(Wire w, const float* x, int64_t n, uint8_t* out, float* err) {
  if (w == Wire::f32) fail("quantize: f32 is not a narrow format");
  if (w == Wire::bf16) {
    for (int64_t i = 0; i < n; ++i) {
      const uint16_t h = float_to_bf16(x[i]);
      std::memcpy(out + 2 * i, &h, 2);
      if (err) err[i] = x[i] - bf16_to_float(h);
    }
    return;
  }
  uint8_t* codes = out + 4 * blocks(n);
  if (w == Wire::e3m0) std::memset(codes, 0, static_cast<size_t>(code_bytes(w, n)));
  for (int64_t b = 0; b < blocks(n); ++b) {
    const int64_t lo = b * kQuantBlock, hi = std::min(n, lo + kQuantBlock);
    float s = 0;
    for (int64_t i = lo; i < hi; ++i) s = std::max(s, std::fabs(x[i]));
    std::memcpy(out + 4 * b, &s, 4);  // a byte buffer: the scales unaligned
    for (int64_t i = lo; i < hi; ++i) {
      float back = 0;
      if (w == Wire::int8) {
        const long q = s > 0 ? std::lround(127.0f * x[i] / s) : 0;
        const int8_t c = static_cast<int8_t>(std::clamp(q, -127L, 127L));
        std::memcpy(codes + i, &c, 1);
        back = static_cast<float>(c) * (s / 127.0f);
      } else {
        uint8_t c = s > 0 ? e3m0_code(std::fabs(x[i]) / s) : 0;
        if (c && std::signbit(x[i])) c |= 8;
        codes[i / 2] |= static_cast<uint8_t>(i % 2 ? c << 4 : c);
        back = e3m0_value(c, s);
      }
      if (err) err[i] = x[i] - back;
    }
  }
}

void dequantize(Wire w, const uint8_t* in, int64_t n, float* x) {
  if (w == Wire::f32) fail("dequantize: f32 is not a narrow format");
  if (w == Wire::bf16) {
    for (int64_t i = 0; i < n; ++i) {
      uint16_t h;
      std::memcpy(&h, in + 2 * i, 2);
      x[i] = bf16_to_float(h);
    }
    return;
  }
  const uint8_t* codes = in + 4 * blocks(n);
  for (int64_t b = 0; b < blocks(n); ++b) {
    float s;
    std::memcpy(&s, in + 4 * b, 4);
    const int64_t lo = b * kQuantBlock, hi = std::min(n, lo + kQuantBlock);
    for (int64_t i = lo; i < hi; ++i) {
      if (w == Wire::int8) {
        int8_t c;
        std::memcpy(&c, codes + i, 1);
        x[i] = static_cast<float>(c) * (s / 127.0f);
      } else {
        x[i] = e3m0_value(static_cast<uint8_t>(i % 2 ? codes[i / 2] >> 4 : codes[i / 2] & 15), s);
      }
    }
  }
}

QuantizedMean::QuantizedMean(comm::Communicator& comm, Wire wire) : comm_(comm), wire_(wire) {
  if (comm.backend() == comm::Backend::nccl) fail("QuantizedMean: host buffers need a host communicator");
}

QuantizedMean::~QuantizedMean() {
  if (stage_ == Stage::idle) return;
  if (std::uncaught_exceptions() == 0) {
    try {
      work_.wait();
      return;
    } catch (const std::exception&) {
    }
  }
  struct Left {
    std::vector<float> f32;
    std::vector<uint8_t> send, recv, gathered;
  };
  (void)new Left{std::move(f32_), std::move(send_), std::move(recv_), std::move(gathered_)};  // never freed
}

void QuantizedMean::start(const float* x, float* error, int64_t n) {
  if (stage_ != Stage::idle) fail("QuantizedMean: an exchange is in flight already");
  n_ = n;
  error_ = error;
  const int64_t world = comm_.size();
  if (wire_ == Wire::f32) {
    f32_.assign(x, x + n);
    bytes_ = n * 4;
    work_ = comm_.all_reduce({f32_.data(), static_cast<size_t>(n), DType::f32, Device::cpu()},
                             {f32_.data(), static_cast<size_t>(n), DType::f32, Device::cpu()}, comm::ReduceOp::sum);
    stage_ = Stage::second;
    return;
  }
  // Chunks of whole blocks (an even count, for e3m0's two codes a byte), padded with zeros.
  const int64_t per = (n + world * kQuantBlock - 1) / (world * kQuantBlock);
  chunk_ = per * kQuantBlock;
  const int64_t cb = wire_bytes(wire_, chunk_);
  std::vector<float> v(static_cast<size_t>(world * chunk_), 0.0f), lost(v.size(), 0.0f);
  for (int64_t i = 0; i < n; ++i) v[i] = x[i] + (error ? error[i] : 0.0f);
  send_.assign(static_cast<size_t>(world * cb), 0);
  for (int64_t r = 0; r < world; ++r)
    quantize(wire_, v.data() + r * chunk_, chunk_, send_.data() + r * cb, error ? lost.data() + r * chunk_ : nullptr);
  if (error) std::copy(lost.begin(), lost.begin() + n, error);
  recv_.assign(send_.size(), 0);
  bytes_ = world * cb;
  const auto bytes_of = [](std::vector<uint8_t>& b) { return comm::Buffer{b.data(), b.size(), DType::u8, Device::cpu()}; };
  work_ = comm_.all_to_all(bytes_of(send_), bytes_of(recv_));
  stage_ = Stage::first;
}

void QuantizedMean::reduce_own_chunk() {
  const int64_t world = comm_.size(), me = comm_.rank(), cb = wire_bytes(wire_, chunk_);
  std::vector<float> sum(static_cast<size_t>(chunk_), 0.0f), part(sum.size()), lost(sum.size());
  for (int64_t r = 0; r < world; ++r) {  // in rank order: the same sum on every rank that does it
    dequantize(wire_, recv_.data() + r * cb, chunk_, part.data());
    for (int64_t i = 0; i < chunk_; ++i) sum[i] += part[i];
  }
  for (float& s : sum) s /= static_cast<float>(world);
  std::vector<uint8_t> mine(static_cast<size_t>(cb));
  quantize(wire_, sum.data(), chunk_, mine.data(), lost.data());
  if (error_)
    for (int64_t i = 0; i < chunk_ && me * chunk_ + i < n_; ++i) error_[me * chunk_ + i] += static_cast<float>(world) * lost[i];
  send_ = std::move(mine);
  gathered_.assign(static_cast<size_t>(world * cb), 0);
  work_ = comm_.all_gather({send_.data(), send_.size(), DType::u8, Device::cpu()},
                           {gathered_.data(), gathered_.size(), DType::u8, Device::cpu()});
}

bool QuantizedMean::progress() {
  if (stage_ == Stage::first && work_.test()) {
    reduce_own_chunk();
    stage_ = Stage::second;
  }
  if (stage_ == Stage::second && work_.test()) stage_ = Stage::done;
  return stage_ == Stage::done || stage_ == Stage::idle;
}

void QuantizedMean::finish(float* mean) {
  if (stage_ == Stage::idle) fail("QuantizedMean: no exchange in flight");
  if (stage_ == Stage::first) {
    work_.wait();
    reduce_own_chunk();
  }
  work_.wait();
  stage_ = Stage::idle;
  const int64_t world = comm_.size();
  if (wire_ == Wire::f32) {
    for (int64_t i = 0; i < n_; ++i) mean[i] = f32_[i] / static_cast<float>(world);
    return;
  }
  const int64_t cb = wire_bytes(wire_, chunk_);
  std::vector<float> part(static_cast<size_t>(chunk_));
  for (int64_t r = 0; r < world; ++r) {
    dequantize(wire_, gathered_.data() + r * cb, chunk_, part.data());
    for (int64_t i = 0; i < chunk_ && r * chunk_ + i < n_; ++i) mean[r * chunk_ + i] = part[i];
  }
}

}  // namespace dtk::compress
