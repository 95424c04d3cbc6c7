// The flight recorder (after NCCL's and PyTorch's): every communicator numbers its operations
// in program order, which is the same on every rank, and each process keeps its last kRing
// operations (communicator, number, kind, size, when issued, when completed) and, per
// communicator, how many it issued and completed. The cost is one uncontended lock and a few
// stores at issue and at completion, so it wraps even the 8-byte all-reduce.
//
// When a wait times out, the watchdog (watchdog.cpp) gathers a Report from every rank that can
// still answer (over its side channel, side_channel.h) and diagnose() names the rank(s) that
// never reached the collective the others wait in, and where they were instead. The reports
// are also what --debug-dir writes (to_json).
//
// "Completed" is when the host saw the operation complete: MPI's wait or test, or the
// communication thread's; NCCL's Work::wait only orders the stream, so there an operation
// counts as completed when the host synchronised with it (synchronize, test). The diagnosis
// needs only what each rank issued.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace dtk::comm::flight {

inline constexpr int kRing = 256;  // operations kept per process

// A communicator in the records: its label ("world", "runtime", "world/1c0": the first split
// of world, colour 0) and its ranks in the world, in its own rank order (empty: not known,
// as for NCCL's splits). Returns its id for issue().
int enrol(const std::string& label, std::vector<int> members);
// The label of the next split of communicator `parent` with colour `color` (counted per parent:
// the same on every rank, since splits are collective).
std::string split_label(int parent, int color);

struct Ticket {
  int comm = -1;
  uint64_t seq = 0;
  bool p2p = false;
};
// Numbered from 1 per communicator. Point-to-point operations (p2p: a send on one rank is a
// receive on another) are numbered apart and never taken for the collective the ranks wait in.
Ticket issue(int comm, const char* kind, size_t bytes, bool p2p = false);
void complete(Ticket t);

struct Op {
  std::string comm, kind;
  uint64_t seq = 0, bytes = 0;
  double issued_ago = 0;  // seconds before the report
  double done_ago = -1;   // seconds before the report; < 0: not completed
  bool p2p = false;
};
struct Comm {
  std::string label;
  uint64_t issued = 0, completed = 0;  // the highest numbers issued and completed
  std::vector<int> members;
};
struct Wait {  // a wait in progress (the watchdog's slots)
  std::string what;
  uint64_t bytes = 0;
  double for_s = 0;
};
struct Report {
  int rank = 0;
  std::string host;
  long pid = 0;
  std::vector<Comm> comms;
  std::vector<Op> ops;  // oldest first
  std::vector<Wait> waits;
};

// This process's records now.
Report snapshot(int rank, std::vector<Wait> waits);
// The side channel's form (lines of tab-separated fields) and back; parse throws dtk::Error on
// text it cannot read.
std::string serialize(const Report& r);
Report parse(const std::string& text);
// The --debug-dir file's form (man/man5/dtk-flight.5).
std::string to_json(const Report& r);

// The one line that says who the ranks wait for: the collective the answering ranks are blocked
// in, the ranks that never reached it (those that did not answer, `silent`; those whose process
// is gone, `exited`; and those whose records show they did not issue it), and where each of them
// is. Empty when the reports show no collective in progress. world_size: the ranks in the job.
std::string diagnose(const std::vector<Report>& answered, const std::vector<int>& silent,
                     const std::vector<int>& exited, int world_size, double timeout_s);

}  // namespace dtk::comm::flight
