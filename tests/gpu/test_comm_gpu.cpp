// The collective checks on device buffers: the nccl backend, and the mpi backend staging through
// pinned host memory. Every test skips itself when this rank sees no GPU.
#include <gtest/gtest.h>

#include "../common/comm_checks.h"

namespace dtk::testing {
namespace {

using comm::Backend;
using comm::Runtime;

class GpuComm : public ::testing::TestWithParam<Backend> {
 protected:
  void SetUp() override {
    // Every rank must take the same branch: skip when any rank lacks a GPU.
    const int missing = Runtime::get().max_over_ranks(cuda::device_count() == 0);
    if (missing) GTEST_SKIP() << "no GPU";
    dev_ = Device::cuda(Runtime::get().local_rank() % cuda::device_count());
    cuda::set_device(dev_.index);
    c_ = Runtime::get().world(GetParam(), dev_);
  }
  Device dev_;
  std::shared_ptr<Communicator> c_;
};

const ReduceOp kOps[] = {ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::min};
const DType kReducible[] = {DType::f32, DType::f64, DType::bf16, DType::f16, DType::i32, DType::i64, DType::u8};

TEST_P(GpuComm, AllReduce) {
  for (DType t : kReducible)
    for (ReduceOp op : kOps)
      for (size_t n : {0, 1, 7, 100003})
        for (bool inplace : {false, true}) check_all_reduce(*c_, dev_, t, op, n, Mode::async, inplace);
}

TEST_P(GpuComm, ReduceScatterAndAllGather) {
  for (DType t : kReducible)
    for (size_t n : {0, 1, 7, 3333})
      for (bool inplace : {false, true}) {
        for (ReduceOp op : kOps) check_reduce_scatter(*c_, dev_, t, op, n, Mode::async, inplace);
        check_all_gather(*c_, dev_, t, n, Mode::sync, inplace);
      }
}

TEST_P(GpuComm, Uneven) {
  for (DType t : kReducible)
    for (size_t extra : {0, 1, 5}) {
      for (ReduceOp op : kOps) check_reduce_scatter_v(*c_, dev_, t, op, extra, Mode::async);
      check_all_gather_v(*c_, dev_, t, extra, Mode::async);
    }
}

TEST_P(GpuComm, BroadcastAllToAllSendRecv) {
  for (DType t : kAllDTypes) {
    for (int root = 0; root < c_->size(); ++root) check_broadcast(*c_, dev_, t, root, 1001, Mode::async);
    for (bool inplace : {false, true}) check_all_to_all(*c_, dev_, t, 37, Mode::async, inplace);
    check_send_recv(*c_, dev_, t, 4097, Mode::async, false);
    if (GetParam() == Backend::mpi) check_send_recv(*c_, dev_, t, 4097, Mode::sync, true);
  }
  c_->barrier();
}

INSTANTIATE_TEST_SUITE_P(Backends, GpuComm, ::testing::Values(Backend::nccl, Backend::mpi),
                         [](const auto& info) { return std::string(comm::backend_name(info.param)); });

}  // namespace
}  // namespace dtk::testing
