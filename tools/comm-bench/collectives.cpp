#include "collectives.h"

#include <algorithm>
#include <cmath>

namespace dtk::bench {
namespace {
using comm::Buffer;
using comm::Communicator;
using comm::Mode;
using comm::ReduceOp;
using comm::Work;

double allreduce_factor(int n) { return 2.0 * (n - 1) / n; }
double spread_factor(int n) { return static_cast<double>(n - 1) / n; }
double one(int) { return 1.0; }
size_t gran_one(int) { return 1; }
size_t gran_n(int n) { return static_cast<size_t>(n); }

// The reduction over ranks of input element i, as the backends compute it.
double reduced(const Params& p, size_t i) {
  double acc = input_value(p.dtype, 0, i);
  for (int q = 1; q < p.nranks; ++q) {
    const double v = input_value(p.dtype, q, i);
    switch (p.op) {
      case ReduceOp::sum:
      case ReduceOp::avg: acc += v; break;
      case ReduceOp::max: acc = std::max(acc, v); break;
      case ReduceOp::min: acc = std::min(acc, v); break;
    }
  }
  if (p.op == ReduceOp::avg) acc = dtype_is_float(p.dtype) ? acc / p.nranks : std::trunc(acc / p.nranks);
  return acc;
}

void same_place(const Counts&, const Params&, size_t* s, size_t* r) { *s = *r = 0; }

const Collective kCollectives[] = {
    {"allreduce", true, false, Layout::either, true, allreduce_factor, gran_one,
     [](size_t count, int) { return Counts{count, count}; }, same_place,
     [](Communicator& c, const Buffer& s, const Buffer& r, const Params& p, Mode m) {
       return c.all_reduce(s, r, p.op, m);
     },
     [](const Params& p, const Counts&, size_t i) { return reduced(p, i); }},

    {"allgather", false, false, Layout::either, true, spread_factor, gran_n,
     [](size_t count, int n) { return Counts{count / n, count}; },
     [](const Counts& c, const Params& p, size_t* s, size_t* r) { *s = p.rank * c.send, *r = 0; },
     [](Communicator& c, const Buffer& s, const Buffer& r, const Params&, Mode m) { return c.all_gather(s, r, m); },
     [](const Params& p, const Counts& c, size_t i) {
       return input_value(p.dtype, static_cast<int>(i / c.send), i % c.send);
     }},

    {"reducescatter", true, false, Layout::either, true, spread_factor, gran_n,
     [](size_t count, int n) { return Counts{count, count / n}; },
     [](const Counts& c, const Params& p, size_t* s, size_t* r) { *s = 0, *r = p.rank * c.recv; },
     [](Communicator& c, const Buffer& s, const Buffer& r, const Params& p, Mode m) {
       return c.reduce_scatter(s, r, p.op, m);
     },
     [](const Params& p, const Counts& c, size_t i) { return reduced(p, p.rank * c.recv + i); }},

    {"broadcast", false, true, Layout::inplace_only, false, one, gran_one,
     [](size_t count, int) { return Counts{count, count}; }, same_place,
     [](Communicator& c, const Buffer&, const Buffer& r, const Params& p, Mode m) { return c.broadcast(r, p.root, m); },
     [](const Params& p, const Counts&, size_t i) { return input_value(p.dtype, p.root, i); }},

    {"alltoall", false, false, Layout::either, true, spread_factor, gran_n,
     [](size_t count, int) { return Counts{count, count}; }, same_place,
     [](Communicator& c, const Buffer& s, const Buffer& r, const Params&, Mode m) { return c.all_to_all(s, r, m); },
     [](const Params& p, const Counts& c, size_t i) {
       const size_t block = c.recv / p.nranks;  // block q came from rank q, its block p.rank
       return input_value(p.dtype, static_cast<int>(i / block), p.rank * block + i % block);
     }},

    {"sendrecv", false, false, Layout::separate_only, true, one, gran_one, [](size_t count, int) { return Counts{count, count}; },
     same_place,
     [](Communicator& c, const Buffer& s, const Buffer& r, const Params& p, Mode m) {
       const int next = (p.rank + 1) % p.nranks, prev = (p.rank - 1 + p.nranks) % p.nranks;
       return c.send_recv(s, next, r, prev, 0, m);
     },
     [](const Params& p, const Counts&, size_t i) {
       return input_value(p.dtype, (p.rank - 1 + p.nranks) % p.nranks, i);
     }},
};

}  // namespace

std::span<const Collective> collectives() { return kCollectives; }

const Collective* find_collective(std::string_view name) {
  for (const auto& c : kCollectives)
    if (c.name == name) return &c;
  return nullptr;
}

double input_value(DType t, int rank, size_t i) {
  const int v = static_cast<int>((i * 7 + static_cast<size_t>(rank) * 3) % 9);
  return (t == DType::u8 || t == DType::u16) ? v : v - 4;
}

}  // namespace dtk::bench
