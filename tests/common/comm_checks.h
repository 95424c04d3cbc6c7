// Exact checks of every collective, shared by the MPI tests (host buffers; mpi and local
// backends) and the GPU tests (device buffers; mpi staging and nccl). Inputs are small integers
// so that every reduction is exact in every dtype and order; worlds of 1, 2 and 4 ranks make avg
// exact too. Every check runs the same communication on every rank whatever it finds (EXPECT,
// never ASSERT), so a failure cannot desynchronise the ranks.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

#include "dtk/comm/comm.h"

namespace dtk::testing {

using comm::Buffer;
using comm::Communicator;
using comm::Mode;
using comm::ReduceOp;

inline double value(DType t, int rank, size_t i) {
  const int v = static_cast<int>((i * 5 + static_cast<size_t>(rank) * 3) % 11);
  return (t == DType::u8 || t == DType::u16) ? v : v - 5;
}

inline double round_to(DType t, double v) {
  unsigned char tmp[8];
  store_from_double(t, tmp, 0, v);
  return load_as_double(t, tmp, 0);
}

inline double reduce_expected(DType t, ReduceOp op, int n, size_t i) {
  double acc = value(t, 0, i);
  for (int q = 1; q < n; ++q) {
    const double v = value(t, q, i);
    acc = op == ReduceOp::max ? std::max(acc, v) : op == ReduceOp::min ? std::min(acc, v) : acc + v;
  }
  if (op == ReduceOp::avg) acc = dtype_is_float(t) ? acc / n : std::trunc(acc / n);
  return round_to(t, acc);
}

// Memory on a device with a host mirror.
class Mem {
 public:
  Mem(DType t, size_t count, Device d) : t_(t), n_(count), d_(d), host_(std::max<size_t>(1, count * dtype_size(t))) {
    dev_ = d.is_cuda() ? cuda::malloc_device(host_.size()) : host_.data();
  }
  ~Mem() {
    if (d_.is_cuda()) cuda::free_device(dev_);
  }
  Mem(const Mem&) = delete;
  Buffer buf(size_t off = 0, size_t count = SIZE_MAX) {
    return {static_cast<char*>(dev_) + off * dtype_size(t_), count == SIZE_MAX ? n_ - off : count, t_, d_};
  }
  void set(size_t i, double v) { store_from_double(t_, host_.data(), i, v); }
  double get(size_t i) const { return load_as_double(t_, host_.data(), i); }
  void upload() {
    if (d_.is_cuda()) cuda::memcpy(dev_, host_.data(), host_.size());
  }
  void download() {
    if (d_.is_cuda()) cuda::memcpy(host_.data(), dev_, host_.size());
  }
  void fill(double v) {
    for (size_t i = 0; i < n_; ++i) set(i, v);
  }

 private:
  DType t_;
  size_t n_;
  Device d_;
  std::vector<unsigned char> host_;
  void* dev_;
};

constexpr double kSentinel = 99;

inline void finish(comm::Work w, Mode mode) {
  if (mode == Mode::async) w.wait();
}

inline void check_all_reduce(Communicator& c, Device d, DType t, ReduceOp op, size_t n, Mode mode, bool inplace) {
  SCOPED_TRACE(::testing::Message() << "all_reduce " << dtype_name(t) << " " << reduce_op_name(op) << " n=" << n
                                    << (inplace ? " in place" : "") << (mode == Mode::async ? " async" : ""));
  Mem a(t, n, d), b(t, n, d);
  for (size_t i = 0; i < n; ++i) a.set(i, value(t, c.rank(), i));
  b.fill(kSentinel);
  a.upload();
  b.upload();
  Mem& out = inplace ? a : b;
  finish(c.all_reduce(a.buf(), out.buf(), op, mode), mode);
  out.download();
  int wrong = 0;
  for (size_t i = 0; i < n; ++i) wrong += out.get(i) != reduce_expected(t, op, c.size(), i);
  EXPECT_EQ(wrong, 0);
}

inline void check_reduce_scatter(Communicator& c, Device d, DType t, ReduceOp op, size_t per_rank, Mode mode,
                                 bool inplace) {
  SCOPED_TRACE(::testing::Message() << "reduce_scatter " << dtype_name(t) << " " << reduce_op_name(op)
                                    << " per_rank=" << per_rank << (inplace ? " in place" : ""));
  const size_t total = per_rank * c.size();
  Mem a(t, total, d), b(t, per_rank, d);
  for (size_t i = 0; i < total; ++i) a.set(i, value(t, c.rank(), i));
  b.fill(kSentinel);
  a.upload();
  b.upload();
  Buffer recv = inplace ? a.buf(c.rank() * per_rank, per_rank) : b.buf();
  finish(c.reduce_scatter(a.buf(), recv, op, mode), mode);
  Mem& out = inplace ? a : b;
  out.download();
  const size_t off = inplace ? c.rank() * per_rank : 0;
  int wrong = 0;
  for (size_t i = 0; i < per_rank; ++i)
    wrong += out.get(off + i) != reduce_expected(t, op, c.size(), c.rank() * per_rank + i);
  EXPECT_EQ(wrong, 0);
}

inline void check_all_gather(Communicator& c, Device d, DType t, size_t per_rank, Mode mode, bool inplace) {
  SCOPED_TRACE(::testing::Message() << "all_gather " << dtype_name(t) << " per_rank=" << per_rank
                                    << (inplace ? " in place" : ""));
  const size_t total = per_rank * c.size();
  Mem a(t, per_rank, d), b(t, total, d);
  b.fill(kSentinel);
  for (size_t i = 0; i < per_rank; ++i) (inplace ? b.set(c.rank() * per_rank + i, value(t, c.rank(), i))
                                                 : a.set(i, value(t, c.rank(), i)));
  a.upload();
  b.upload();
  Buffer send = inplace ? b.buf(c.rank() * per_rank, per_rank) : a.buf();
  finish(c.all_gather(send, b.buf(), mode), mode);
  b.download();
  int wrong = 0;
  for (size_t i = 0; i < total; ++i) wrong += b.get(i) != round_to(t, value(t, static_cast<int>(i / per_rank), i % per_rank));
  EXPECT_EQ(wrong, 0);
}

// Uneven blocks: rank r owns 3r + extra elements (extra 0 gives rank 0 an empty block).
inline std::vector<size_t> uneven_counts(int n, size_t extra) {
  std::vector<size_t> v(n);
  for (int r = 0; r < n; ++r) v[r] = 3 * r + extra;
  return v;
}

inline void check_reduce_scatter_v(Communicator& c, Device d, DType t, ReduceOp op, size_t extra, Mode mode) {
  SCOPED_TRACE(::testing::Message() << "reduce_scatter_v " << dtype_name(t) << " extra=" << extra);
  const auto counts = uneven_counts(c.size(), extra);
  const size_t total = std::accumulate(counts.begin(), counts.end(), size_t{0});
  size_t off = 0;
  for (int r = 0; r < c.rank(); ++r) off += counts[r];
  Mem a(t, total, d), b(t, counts[c.rank()], d);
  for (size_t i = 0; i < total; ++i) a.set(i, value(t, c.rank(), i));
  b.fill(kSentinel);
  a.upload();
  b.upload();
  finish(c.reduce_scatter_v(a.buf(), b.buf(), counts, op, mode), mode);
  b.download();
  int wrong = 0;
  for (size_t i = 0; i < counts[c.rank()]; ++i) wrong += b.get(i) != reduce_expected(t, op, c.size(), off + i);
  EXPECT_EQ(wrong, 0);
}

inline void check_all_gather_v(Communicator& c, Device d, DType t, size_t extra, Mode mode) {
  SCOPED_TRACE(::testing::Message() << "all_gather_v " << dtype_name(t) << " extra=" << extra);
  const auto counts = uneven_counts(c.size(), extra);
  const size_t total = std::accumulate(counts.begin(), counts.end(), size_t{0});
  Mem a(t, counts[c.rank()], d), b(t, total, d);
  for (size_t i = 0; i < counts[c.rank()]; ++i) a.set(i, value(t, c.rank(), i));
  b.fill(kSentinel);
  a.upload();
  b.upload();
  finish(c.all_gather_v(a.buf(), b.buf(), counts, mode), mode);
  b.download();
  int wrong = 0;
  size_t i = 0;
  for (int r = 0; r < c.size(); ++r)
    for (size_t k = 0; k < counts[r]; ++k, ++i) wrong += b.get(i) != round_to(t, value(t, r, k));
  EXPECT_EQ(wrong, 0);
}

inline void check_broadcast(Communicator& c, Device d, DType t, int root, size_t n, Mode mode) {
  SCOPED_TRACE(::testing::Message() << "broadcast " << dtype_name(t) << " root=" << root << " n=" << n);
  Mem a(t, n, d);
  for (size_t i = 0; i < n; ++i) a.set(i, value(t, c.rank(), i));
  a.upload();
  finish(c.broadcast(a.buf(), root, mode), mode);
  a.download();
  int wrong = 0;
  for (size_t i = 0; i < n; ++i) wrong += a.get(i) != round_to(t, value(t, root, i));
  EXPECT_EQ(wrong, 0);
}

inline void check_all_to_all(Communicator& c, Device d, DType t, size_t block, Mode mode, bool inplace) {
  SCOPED_TRACE(::testing::Message() << "all_to_all " << dtype_name(t) << " block=" << block
                                    << (inplace ? " in place" : ""));
  const size_t total = block * c.size();
  Mem a(t, total, d), b(t, total, d);
  for (size_t i = 0; i < total; ++i) a.set(i, value(t, c.rank(), i));
  b.fill(kSentinel);
  a.upload();
  b.upload();
  Mem& out = inplace ? a : b;
  finish(c.all_to_all(a.buf(), out.buf(), mode), mode);
  out.download();
  int wrong = 0;
  for (size_t i = 0; i < total; ++i)
    wrong += out.get(i) != round_to(t, value(t, static_cast<int>(i / block), c.rank() * block + i % block));
  EXPECT_EQ(wrong, 0);
}

// A ring: each rank sends to the next and receives from the previous, with send_recv, or with
// a separate send and receive (even ranks send first; not for NCCL, which needs the group).
inline void check_send_recv(Communicator& c, Device d, DType t, size_t n, Mode mode, bool separate) {
  SCOPED_TRACE(::testing::Message() << "send/recv " << dtype_name(t) << " n=" << n << (separate ? " separate" : ""));
  const int next = (c.rank() + 1) % c.size(), prev = (c.rank() + c.size() - 1) % c.size();
  Mem a(t, n, d), b(t, n, d);
  for (size_t i = 0; i < n; ++i) a.set(i, value(t, c.rank(), i));
  b.fill(kSentinel);
  a.upload();
  b.upload();
  if (separate) {
    comm::Work r = c.recv(b.buf(), prev, 3);
    comm::Work s = c.send(a.buf(), next, 3);
    s.wait();
    r.wait();
  } else {
    finish(c.send_recv(a.buf(), next, b.buf(), prev, 3, mode), mode);
  }
  b.download();
  int wrong = 0;
  for (size_t i = 0; i < n; ++i) wrong += b.get(i) != round_to(t, value(t, prev, i));
  EXPECT_EQ(wrong, 0);
}

}  // namespace dtk::testing
