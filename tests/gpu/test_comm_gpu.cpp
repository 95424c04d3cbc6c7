// The collective checks on device buffers: the nccl backend, and the mpi backend staging through
// pinned host memory. Every test skips itself when a rank sees no GPU, and the nccl case when
// two ranks of a host would share a GPU (mpiexec -n 2 on a one-GPU machine: NCCL refuses that,
// and Runtime says so first); both decided over all ranks, so every rank takes the same branch.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "../common/comm_checks.h"
#include "dtk/comm/flight.h"
#include "dtk/core/tensor.h"

namespace dtk::testing {
namespace {

using comm::Backend;
using comm::Runtime;

class GpuComm : public ::testing::TestWithParam<Backend> {
 protected:
  void SetUp() override {
    Runtime& rt = Runtime::get();
    if (rt.max_over_ranks(cuda::device_count() == 0)) GTEST_SKIP() << "no GPU";
    if (GetParam() == Backend::nccl) {
      if (const std::string why = rt.gpu_sharing(); !why.empty()) GTEST_SKIP() << why;
    }
    dev_ = rt.bind_device(Device::cuda());
    c_ = rt.world(GetParam(), dev_);
  }
  Device dev_;
  std::shared_ptr<Communicator> c_;
};

const ReduceOp kOps[] = {ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::min};
const DType kReducible[] = {DType::f32, DType::f64, DType::bf16, DType::f16, DType::i32, DType::i64, DType::u8};
const Mode kModes[] = {Mode::async, Mode::sync};

TEST_P(GpuComm, AllReduce) {
  for (Mode mode : kModes)
    for (DType t : kReducible)
      for (ReduceOp op : kOps)
        for (size_t n : {0, 1, 7, 100003})
          for (bool inplace : {false, true}) check_all_reduce(*c_, dev_, t, op, n, mode, inplace);
}

TEST_P(GpuComm, ReduceScatterAndAllGather) {
  for (Mode mode : kModes)
    for (DType t : kReducible)
      for (size_t n : {0, 1, 7, 3333})
        for (bool inplace : {false, true}) {
          for (ReduceOp op : kOps) check_reduce_scatter(*c_, dev_, t, op, n, mode, inplace);
          check_all_gather(*c_, dev_, t, n, mode, inplace);
        }
}

TEST_P(GpuComm, Uneven) {
  for (Mode mode : kModes)
    for (DType t : kReducible)
      for (size_t extra : {0, 1, 5}) {
        for (ReduceOp op : kOps) check_reduce_scatter_v(*c_, dev_, t, op, extra, mode);
        check_all_gather_v(*c_, dev_, t, extra, mode);
      }
}

TEST_P(GpuComm, BroadcastAllToAllSendRecv) {
  for (Mode mode : kModes)
    for (DType t : kAllDTypes) {
      for (int root = 0; root < c_->size(); ++root) check_broadcast(*c_, dev_, t, root, 1001, mode);
      for (bool inplace : {false, true}) check_all_to_all(*c_, dev_, t, 37, mode, inplace);
      check_send_recv(*c_, dev_, t, 4097, mode, false);
      if (GetParam() == Backend::mpi) check_send_recv(*c_, dev_, t, 4097, mode, true);
    }
  c_->barrier(Mode::sync).wait();
  c_->barrier(Mode::async).wait();
}

// Work::synchronize: the host has waited for completion, so a copy on another stream (not
// ordered after the operation, as the current stream is by wait()) reads the result.
TEST_P(GpuComm, SynchronizeCompletesOnTheHost) {
  const int64_t n = 1 << 22;  // big enough that a copy racing the collective would see old values
  Tensor x = Tensor::from_doubles(std::vector<double>(n, 1.0), {n}, DType::f32, dev_);
  comm::Work w = c_->all_reduce(comm::buffer_of(x), comm::buffer_of(x), ReduceOp::sum, Mode::async);
  w.synchronize();
  Tensor host = Tensor::empty({n}, DType::f32);
  const Stream other = cuda::create_stream();
  cuda::memcpy_async(host.data(), x.data(), x.bytes(), other);
  cuda::stream_synchronize(other);
  cuda::destroy_stream(other);
  int64_t wrong = 0;
  for (int64_t i = 0; i < n; ++i) wrong += host.ptr<float>()[i] != static_cast<float>(c_->size());
  EXPECT_EQ(wrong, 0);
}

// HSDP's pattern: a shard group and a replica group split from the world, their collectives
// interleaved as FSDP issues them (a reduce-scatter in one, then an all-reduce of its result in
// the other, several in flight). On NCCL both groups share one stream, so this cannot deadlock
// whatever the GPUs run concurrently; the results must be exact.
TEST_P(GpuComm, SplitGroupsInterleaved) {
  const int n = c_->size(), S = n % 2 == 0 ? n / 2 : n;  // 4 ranks: 2 groups of 2
  // Each split is enrolled in the flight recorder with its members' world ranks (here the
  // world's ranks), in its rank order: those that a hang names.
  const auto newest = [] { return comm::flight::snapshot(0, {}).comms.back(); };
  auto shard = c_->split(c_->rank() / S, c_->rank());
  const comm::flight::Comm shard_rec = newest();
  auto replica = c_->split(c_->rank() % S, c_->rank());
  const comm::flight::Comm replica_rec = newest();
  ASSERT_EQ(shard->size(), S);
  ASSERT_EQ(replica->size(), n / S);
  std::vector<int> shard_ranks, replica_ranks;
  for (int q = 0; q < n; ++q) {
    if (q / S == c_->rank() / S) shard_ranks.push_back(q);
    if (q % S == c_->rank() % S) replica_ranks.push_back(q);
  }
  EXPECT_EQ(shard_rec.members, shard_ranks) << shard_rec.label;
  EXPECT_EQ(replica_rec.members, replica_ranks) << replica_rec.label;
  const size_t per = 1001;
  constexpr int kRounds = 4;
  std::vector<std::unique_ptr<Mem>> send, recv;
  std::vector<comm::Work> works;
  for (int k = 0; k < kRounds; ++k) {
    send.push_back(std::make_unique<Mem>(DType::f32, per * S, dev_));
    recv.push_back(std::make_unique<Mem>(DType::f32, per, dev_));
    for (size_t i = 0; i < per * S; ++i) send[k]->set(i, value(DType::f32, c_->rank(), i + k));
    send[k]->upload();
    works.push_back(shard->reduce_scatter(send[k]->buf(), recv[k]->buf(), ReduceOp::sum, Mode::async));
  }
  for (int k = 0; k < kRounds; ++k) {
    works[k].wait();
    works[k] = replica->all_reduce(recv[k]->buf(), recv[k]->buf(), ReduceOp::sum, Mode::async);
  }
  for (auto& w : works) w.wait();
  int wrong = 0;
  for (int k = 0; k < kRounds; ++k) {
    recv[k]->download();
    for (size_t i = 0; i < per; ++i) {
      double want = 0;  // every rank's element at this shard rank's block
      for (int q = 0; q < n; ++q) want += value(DType::f32, q, shard->rank() * per + i + k);
      wrong += recv[k]->get(i) != want;
    }
  }
  EXPECT_EQ(wrong, 0);
  shard->barrier(Mode::sync).wait();
  replica->barrier(Mode::sync).wait();
}

// A Work dropped unwaited (comm.h): the stream that issued it waits for the operation all the
// same (NCCL), or its destructor completes it (MPI staging), so a copy queued on that stream
// afterwards reads the result. Out of place, so that one rank's all-reduce still writes, behind
// other collectives that keep the lane busy for milliseconds: a copy not ordered after it would
// read the zeros.
TEST_P(GpuComm, ADroppedWorkOrdersTheIssuingStream) {
  const int64_t big = 1 << 24, n = 1 << 22;
  const Tensor busy_in = Tensor::zeros({big}, DType::f32, dev_);
  Tensor busy_out = Tensor::zeros({big}, DType::f32, dev_);
  std::vector<comm::Work> ahead;
  for (int k = 0; k < 4; ++k)
    ahead.push_back(
        c_->all_reduce(comm::buffer_of(busy_in), comm::buffer_of(busy_out), ReduceOp::sum, Mode::async));
  Tensor x = Tensor::from_doubles(std::vector<double>(n, 1.0), {n}, DType::f32, dev_);
  Tensor y = Tensor::zeros({n}, DType::f32, dev_);
  { comm::Work dropped = c_->all_reduce(comm::buffer_of(x), comm::buffer_of(y), ReduceOp::sum, Mode::async); }
  const Tensor host = y.to(Device::cpu());
  comm::wait_all(ahead);
  int64_t wrong = 0;
  for (int64_t i = 0; i < n; ++i) wrong += host.ptr<float>()[i] != static_cast<float>(c_->size());
  EXPECT_EQ(wrong, 0);
}

// The caching allocator's release (cudaFree waits for every stream of the device, NCCL's
// included) is a wait for the GPU through the wait hook, watched like any other. Here a stream
// that is not the current one is held by a host function until the hook, polled, lets it go: the
// frees must be waited for in the hook (freeing on this thread would block for ever).
std::atomic<bool> g_let_go{false};
std::atomic<int> g_polls{0};
void CUDART_CB hold_stream(void*) {
  while (!g_let_go.load()) std::this_thread::yield();
}
void counting_hook(const char*, size_t, bool (*done)(void*), void* event) {
  while (!done(event)) {
    if (++g_polls == 100) g_let_go = true;
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

TEST_P(GpuComm, ReleasingCachedMemoryIsAWatchedWait) {
  if (GetParam() != Backend::nccl) GTEST_SKIP() << "the allocator's, not a backend's: run once";
  { const Tensor cached = Tensor::empty({1 << 20}, DType::f32, dev_); }  // a block for the cache to give back
  const Stream held = cuda::create_stream();
  ASSERT_EQ(cudaLaunchHostFunc(static_cast<cudaStream_t>(held.handle), hold_stream, nullptr), cudaSuccess);
  cuda::set_wait_hook(&counting_hook);
  empty_cache(dev_);
  cuda::set_wait_hook(&comm::wait_for_device);
  EXPECT_GE(g_polls.load(), 100);  // the frees waited, in the hook, for the held stream
  g_let_go = true;
  cuda::stream_synchronize(held);
  cuda::destroy_stream(held);
  EXPECT_EQ(memory_stats(dev_).reserved, memory_stats(dev_).current);
}

INSTANTIATE_TEST_SUITE_P(Backends, GpuComm, ::testing::Values(Backend::nccl, Backend::mpi),
                         [](const auto& info) { return std::string(comm::backend_name(info.param)); });

}  // namespace
}  // namespace dtk::testing
