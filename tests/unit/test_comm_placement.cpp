// NCCL's one GPU per rank, decided before NCCL sees the ranks (comm::shared_gpu_problem): two
// ranks of a host on one physical GPU are refused with one line that names them; ranks that
// each see their own GPU as index 0 are not.
#include <gtest/gtest.h>

#include "dtk/comm/comm.h"

namespace dtk::comm {
namespace {

TEST(GpuPlacement, TwoRanksOnOneGpuAreRefused) {
  // mpiexec -n 2 on a host with one GPU: both ranks take index 0 % 1 = 0.
  const std::string p = shared_gpu_problem({{"node1", "GPU-aaaa", 0, 1}, {"node1", "GPU-aaaa", 0, 1}});
  EXPECT_NE(p.find("ranks 0 and 1 on host node1 both use GPU 0"), std::string::npos) << p;
  EXPECT_NE(p.find("at most 1 rank per host"), std::string::npos) << p;
  EXPECT_NE(p.find("--backend mpi"), std::string::npos) << p;
  EXPECT_EQ(p.find('\n'), std::string::npos) << "one line";
}

TEST(GpuPlacement, TheFirstSharedPairIsNamed) {
  // 3 ranks on a 2-GPU host: ranks 0 and 2 share GPU 0; another host is fine.
  const std::string p = shared_gpu_problem({{"a", "GPU-0", 0, 2},
                                            {"a", "GPU-1", 1, 2},
                                            {"a", "GPU-0", 0, 2},
                                            {"b", "GPU-0", 0, 2}});
  EXPECT_NE(p.find("ranks 0 and 2 on host a both use GPU 0 (2 visible to each): start at most 2 ranks"),
            std::string::npos)
      << p;
}

TEST(GpuPlacement, OwnGpusAreAccepted) {
  // srun --gpus-per-task=1: every rank sees one GPU, its own, as index 0.
  EXPECT_EQ(shared_gpu_problem({{"n", "GPU-a", 0, 1}, {"n", "GPU-b", 0, 1}, {"n", "GPU-c", 0, 1}}), "");
  // One rank per GPU of a host; the same UUID on two hosts is two GPUs (hosts do not share).
  EXPECT_EQ(shared_gpu_problem({{"n", "GPU-a", 0, 2}, {"n", "GPU-b", 1, 2}, {"m", "GPU-a", 0, 2}}), "");
  EXPECT_EQ(shared_gpu_problem({}), "");
}

// Two hosts of one name (netlab's namespaces: each its own network namespace, one host name;
// cloned machines: their own boot ids) are refused before Open MPI splits the ranks by host.
TEST(HostIdentity, OneNameOnTwoHostsIsRefused) {
  const std::string p = repeated_host_name_problem(
      {{"vm", "b1 net:[1]"}, {"vm", "b1 net:[1]"}, {"vm", "b1 net:[2]"}, {"vm", "b1 net:[2]"}});
  EXPECT_NE(p.find("ranks 0 and 2 both run on a host named 'vm', but on different hosts"), std::string::npos) << p;
  EXPECT_NE(p.find("unshare --uts"), std::string::npos) << p;
  EXPECT_EQ(p.find('\n'), std::string::npos) << "one line";
  EXPECT_NE(repeated_host_name_problem({{"n", "boot-a net:[1]"}, {"n", "boot-b net:[1]"}}), "");  // cloned machines
}

TEST(HostIdentity, NamesThatTellHostsApartAreAccepted) {
  // Several ranks of a host; two hosts with their own names; SLURM's emulated nodes of one host
  // (one name, one machine); a rank whose /proc says nothing is not compared.
  EXPECT_EQ(repeated_host_name_problem({{"a", "b net:[1]"}, {"a", "b net:[1]"}, {"c", "b net:[2]"}}), "");
  EXPECT_EQ(repeated_host_name_problem({{"a", "x"}, {"a", ""}, {"a", "x"}}), "");
  EXPECT_EQ(repeated_host_name_problem({}), "");
}

}  // namespace
}  // namespace dtk::comm
