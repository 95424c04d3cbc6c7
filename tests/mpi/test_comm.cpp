// Every collective x dtype x reduction x mode on host buffers, over the mpi backend (and the local
// backend in a world of one). Run under mpiexec -n 1, 2 and 4 (see tests/CMakeLists.txt).
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <string>

#include "../common/comm_checks.h"
#include "dtk/comm/flight.h"
#include "dtk/core/error.h"

namespace dtk::testing {
namespace {

using comm::Backend;
using comm::Runtime;

std::vector<std::shared_ptr<Communicator>> communicators() {
  std::vector<std::shared_ptr<Communicator>> out{Runtime::get().world(Backend::mpi)};
  if (Runtime::get().size() == 1) out.push_back(Runtime::get().world(Backend::local));
  return out;
}

const ReduceOp kOps[] = {ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::min};
const Mode kModes[] = {Mode::sync, Mode::async};
const size_t kCounts[] = {0, 1, 7, 1003, (1 << 18) + 3};  // the last: >= 1 MiB (4- and 8-byte types): the large path

TEST(Comm, Topology) {
  for (auto& c : communicators()) {
    EXPECT_EQ(c->size(), Runtime::get().size());
    EXPECT_EQ(c->rank(), Runtime::get().rank());
    EXPECT_GE(c->local_rank(), 0);
    EXPECT_LT(c->local_rank(), c->local_size());
  }
}

// DTK_ALLREDUCE_ALGO=auto selects Open MPI's ring for nonblocking all-reduces at MPI_Init
// (unless set); mpi leaves the variable alone.
TEST(Comm, AllReduceAlgorithmSelected) {
  Runtime::get().world(Backend::mpi);
  const char* algo = std::getenv("DTK_ALLREDUCE_ALGO");
  const char* v = std::getenv("OMPI_MCA_coll_libnbc_iallreduce_algorithm");
  if (algo && std::string(algo) == "mpi")
    EXPECT_EQ(v, nullptr);
  else
    EXPECT_STREQ(v, "1");
}

TEST(Comm, AllReduce) {
  for (auto& c : communicators())
    for (DType t : kAllDTypes)
      for (ReduceOp op : kOps)
        for (Mode m : kModes)
          for (size_t n : kCounts)
            for (bool inplace : {false, true}) check_all_reduce(*c, Device::cpu(), t, op, n, m, inplace);
}

TEST(Comm, ReduceScatter) {
  for (auto& c : communicators())
    for (DType t : kAllDTypes)
      for (ReduceOp op : kOps)
        for (Mode m : kModes)
          for (size_t n : {0, 1, 7, 333})
            for (bool inplace : {false, true}) check_reduce_scatter(*c, Device::cpu(), t, op, n, m, inplace);
}

TEST(Comm, AllGather) {
  for (auto& c : communicators())
    for (DType t : kAllDTypes)
      for (Mode m : kModes)
        for (size_t n : {0, 1, 7, 333})
          for (bool inplace : {false, true}) check_all_gather(*c, Device::cpu(), t, n, m, inplace);
}

TEST(Comm, UnevenReduceScatterAndAllGather) {
  for (auto& c : communicators())
    for (DType t : kAllDTypes)
      for (Mode m : kModes)
        for (size_t extra : {0, 1, 5}) {
          for (ReduceOp op : kOps) check_reduce_scatter_v(*c, Device::cpu(), t, op, extra, m);
          check_all_gather_v(*c, Device::cpu(), t, extra, m);
        }
}

TEST(Comm, Broadcast) {
  for (auto& c : communicators())
    for (DType t : kAllDTypes)
      for (Mode m : kModes)
        for (int root = 0; root < c->size(); ++root)
          for (size_t n : kCounts) check_broadcast(*c, Device::cpu(), t, root, n, m);
}

TEST(Comm, AllToAll) {
  for (auto& c : communicators())
    for (DType t : kAllDTypes)
      for (Mode m : kModes)
        for (size_t block : {0, 1, 7, 100})
          for (bool inplace : {false, true}) check_all_to_all(*c, Device::cpu(), t, block, m, inplace);
}

TEST(Comm, SendRecvRing) {
  for (auto& c : communicators())
    for (DType t : kAllDTypes)
      for (size_t n : kCounts)
        for (Mode m : kModes)
          for (bool separate : {false, true}) check_send_recv(*c, Device::cpu(), t, n, m, separate);
}

TEST(Comm, ManyOperationsInFlight) {
  for (auto& c : communicators()) {
    std::vector<std::vector<float>> bufs(8, std::vector<float>(100));
    std::vector<comm::Work> works;
    for (size_t k = 0; k < bufs.size(); ++k) {
      for (size_t i = 0; i < 100; ++i) bufs[k][i] = static_cast<float>(k + i + c->rank());
      works.push_back(c->all_reduce({bufs[k].data(), 100, DType::f32, {}}, {bufs[k].data(), 100, DType::f32, {}},
                                    ReduceOp::sum));
    }
    comm::wait_all(works);
    const int n = c->size();
    int wrong = 0;
    for (size_t k = 0; k < bufs.size(); ++k)
      for (size_t i = 0; i < 100; ++i) wrong += bufs[k][i] != static_cast<float>(n * (k + i) + n * (n - 1) / 2);
    EXPECT_EQ(wrong, 0);
    c->barrier().wait();
    c->barrier(Mode::async).wait();
  }
}

// Asynchronous collectives progress while the caller computes without calling MPI (the
// communication thread): after a busy loop ten times as long as the collective takes alone
// (started and waited at once), its wait() takes less than half of that.
TEST(Comm, AsyncCollectivesProgressWhileTheCallerComputes) {
  auto c = Runtime::get().world(Backend::mpi);
  if (c->size() == 1) GTEST_SKIP() << "one rank: nothing travels";
  if (const char* e = std::getenv("DTK_COMM_THREAD"); e && std::string(e) == "0")
    GTEST_SKIP() << "DTK_COMM_THREAD=0: MPI's nonblocking calls progress only inside MPI calls";
  // Open MPI's shared memory without single-copy (the tests' setting, for containers that forbid
  // it) moves large messages in fragments, one batch per poll of the communication thread, and a
  // thread that shares its core with a busy caller polls once per time slice: measured here, a
  // 2 ms all-gather made almost no progress during 20 ms of computation.
  if (const char* e = std::getenv("OMPI_MCA_btl_vader_single_copy_mechanism"); e && std::string(e) == "none")
    GTEST_SKIP() << "Open MPI's shared memory without single-copy: progress during computation is not guaranteed";
  using Clock = std::chrono::steady_clock;
  auto secs = [](Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); };
  const size_t n = 2u << 20;  // 8 MiB of f32 per rank
  std::vector<float> send(n, 1.0f), recv(n * static_cast<size_t>(c->size()));
  const comm::Buffer s{send.data(), n, DType::f32, {}}, r{recv.data(), recv.size(), DType::f32, {}};
  for (const bool gather : {true, false}) {
    auto op = [&](Mode m) {
      return gather ? c->all_gather(s, r, m) : c->reduce_scatter(r, s, ReduceOp::sum, m);
    };
    c->barrier().wait();
    auto t0 = Clock::now();
    op(Mode::async).wait();
    double alone = secs(t0);
    c->all_reduce({&alone, 1, DType::f64, {}}, {&alone, 1, DType::f64, {}}, ReduceOp::max).wait();
    c->barrier().wait();
    comm::Work w = op(Mode::async);
    t0 = Clock::now();
    volatile double sink = 0;
    while (secs(t0) < std::max(0.02, 10 * alone)) sink = sink + 1.0;
    t0 = Clock::now();
    w.wait();
    const double waited = secs(t0);
    EXPECT_LT(waited, 0.5 * alone) << (gather ? "all_gather" : "reduce_scatter");
  }
}

TEST(Comm, SplitByColour) {
  for (auto& c : communicators()) {
    // Two colours, ranks ordered backwards inside each.
    auto sub = c->split(c->rank() % 2, -c->rank());
    const int colour_size = (c->size() + 1 - c->rank() % 2) / 2;
    EXPECT_EQ(sub->size(), colour_size);
    EXPECT_EQ(sub->rank(), colour_size - 1 - c->rank() / 2);
    int64_t v = c->rank(), sum = 0;
    sub->all_reduce({&v, 1, DType::i64, {}}, {&sum, 1, DType::i64, {}}, ReduceOp::sum, Mode::sync).wait();
    int64_t want = 0;
    for (int r = c->rank() % 2; r < c->size(); r += 2) want += r;
    EXPECT_EQ(sum, want);
    check_all_reduce(*sub, Device::cpu(), DType::bf16, ReduceOp::sum, 7, Mode::async, false);
  }
}

// A split is an operation of its parent in the flight recorder, and the communicator it makes is
// enrolled with its members' world ranks in its rank order, which name the ranks of a hung
// HSDP group (the same check runs on NCCL in tests/gpu/test_comm_gpu.cpp).
TEST(Comm, SplitsAreRecordedWithTheirWorldRanks) {
  auto c = Runtime::get().world(Backend::mpi);
  const auto comm_of = [](const comm::flight::Report& r, const std::string& label) {
    for (const comm::flight::Comm& x : r.comms)
      if (x.label == label) return x;
    ADD_FAILURE() << "no communicator " << label;
    return comm::flight::Comm{};
  };
  const uint64_t before = comm_of(comm::flight::snapshot(0, {}), "world").issued;
  auto sub = c->split(c->rank() % 2, -c->rank());  // backwards within each colour
  const comm::flight::Report r = comm::flight::snapshot(0, {});
  EXPECT_EQ(comm_of(r, "world").issued, before + 1);
  EXPECT_EQ(r.ops.back().kind, "split");
  EXPECT_GE(r.ops.back().done_ago, 0);
  const comm::flight::Comm& mine = r.comms.back();  // the newest
  EXPECT_EQ(mine.label.rfind("world/", 0), 0u) << mine.label;
  std::vector<int> want;
  for (int q = c->size() - 1; q >= 0; --q)
    if (q % 2 == c->rank() % 2) want.push_back(q);
  EXPECT_EQ(mine.members, want);
  EXPECT_EQ(static_cast<int>(mine.members.size()), sub->size());
}

// An async Work dropped unwaited (comm.h) on MPI's own nonblocking calls (no communication
// thread): its destructor completes it, its result there and its record completed.
TEST(Comm, ADroppedWorkIsCompleted) {
  if (const char* e = std::getenv("DTK_COMM_THREAD"); !(e && std::string(e) == "0"))
    GTEST_SKIP() << "the communication thread completes its operations itself (DTK_COMM_THREAD=0 runs this)";
  auto c = Runtime::get().world(Backend::mpi);
  std::vector<float> v(1000, static_cast<float>(c->rank() + 1));
  { comm::Work dropped = c->all_reduce({v.data(), v.size(), DType::f32, {}}, {v.data(), v.size(), DType::f32, {}},
                                       ReduceOp::sum); }
  const float want = static_cast<float>(c->size() * (c->size() + 1) / 2);
  int wrong = 0;
  for (float x : v) wrong += x != want;
  EXPECT_EQ(wrong, 0);
  for (const comm::flight::Comm& x : comm::flight::snapshot(0, {}).comms)
    if (x.label == "world") {
      EXPECT_EQ(x.completed, x.issued);
    }
}

TEST(Comm, BadArgumentsAreUsageErrors) {
  for (auto& c : communicators()) {
    std::vector<float> a(8), b(3);
    Buffer A{a.data(), 8, DType::f32, {}}, B{b.data(), 3, DType::f32, {}};
    EXPECT_THROW((void)c->all_reduce(A, B, ReduceOp::sum), UsageError);
    EXPECT_THROW((void)c->all_gather(A, B, Mode::sync), UsageError);
    EXPECT_THROW((void)c->broadcast(A, c->size()), UsageError);
    EXPECT_THROW((void)c->send(A, -1), UsageError);
    Buffer I{a.data(), 8, DType::i32, {}};
    EXPECT_THROW((void)c->all_reduce(A, I, ReduceOp::sum), UsageError);
    EXPECT_THROW((void)c->reduce_scatter_v(A, B, {1}, ReduceOp::sum), UsageError);
    EXPECT_THROW((void)c->all_to_all(A, B), UsageError);
  }
}

}  // namespace
}  // namespace dtk::testing
