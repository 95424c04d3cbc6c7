// The table of collectives that drives comm-bench's one engine: what each sends and receives for a
// size, how to run it, what every received element must be, and its bus-bandwidth factor.
// Adding a collective is adding one entry to kCollectives.
#pragma once
#include <span>
#include <string_view>

#include "dtk/comm/comm.h"

namespace dtk::bench {

struct Params {
  comm::ReduceOp op = comm::ReduceOp::sum;
  int root = 0;
  DType dtype = DType::f32;
  int rank = 0;
  int nranks = 1;
};

// Buffers of a run: send and recv element counts for the measured `count` (see Collective::counts).
struct Counts {
  size_t send = 0, recv = 0;
};

// Whether send and recv may share one buffer (--inplace), must (broadcast), or must not.
enum class Layout { either, inplace_only, separate_only };

struct Collective {
  std::string_view name;
  bool reduces;  // takes --redop
  bool rooted;   // takes --root
  Layout layout;
  // Whether the rank that arrives last makes every other rank wait: directly (every rank's result
  // needs every rank's input) or along the ring of back-to-back sendrecvs. Then, in an iteration,
  // the rank that spent the least time in the operation is the one that arrived last (the
  // straggler report). Not broadcast: the root waits for no one.
  bool everyone_waits;
  double (*bus_factor)(int n);
  // The size-defining buffer holds `count` elements (a multiple of granularity(n)).
  size_t (*granularity)(int n);
  Counts (*counts)(size_t count, int n);
  // In-place layout: where send and recv sit in one buffer of max(send, recv) elements.
  // Returns the element offsets of send and recv in it.
  void (*inplace_offsets)(const Counts& c, const Params& p, size_t* send_off, size_t* recv_off);
  comm::Work (*run)(comm::Communicator& c, const comm::Buffer& send, const comm::Buffer& recv, const Params& p,
                    comm::Mode mode);
  // What element i of rank p.rank's receive buffer must hold.
  double (*expected)(const Params& p, const Counts& c, size_t i);
};

std::span<const Collective> collectives();
const Collective* find_collective(std::string_view name);

// The input pattern: element i of rank r. Small integers, so that every reduction is exact in
// every dtype and every order (|sum| <= 4 * ranks; unsigned types use 0..8).
double input_value(DType t, int rank, size_t i);

}  // namespace dtk::bench
