// The flight recorder (comm/flight.h): numbering, the ring, the side channel's form and the
// diagnosis of a collective timeout from the reports of the ranks that answered.
#include <gtest/gtest.h>

#include "dtk/comm/flight.h"
#include "dtk/core/error.h"

namespace dtk::comm::flight {
namespace {

const Comm* comm_of(const Report& r, const std::string& label) {
  for (const Comm& c : r.comms)
    if (c.label == label) return &c;
  return nullptr;
}

TEST(Flight, NumbersCollectivesPerCommunicatorAndKeepsTheLastOnes) {
  const int a = enrol("test-a", {0, 1});
  const int b = enrol("test-b", {});
  const Ticket t1 = issue(a, "all_reduce", 8);
  const Ticket t2 = issue(a, "broadcast", 4);
  const Ticket p = issue(a, "send", 16, true);
  const Ticket u = issue(b, "all_gather", 64);
  EXPECT_EQ(t1.seq, 1u);
  EXPECT_EQ(t2.seq, 2u);
  EXPECT_EQ(p.seq, 1u);  // point to point: numbered apart
  EXPECT_EQ(u.seq, 1u);
  complete(t1);
  complete(p);
  Report r = snapshot(3, {{"broadcast", 4, 0.5}});
  EXPECT_EQ(r.rank, 3);
  ASSERT_TRUE(comm_of(r, "test-a"));
  EXPECT_EQ(comm_of(r, "test-a")->issued, 2u);
  EXPECT_EQ(comm_of(r, "test-a")->completed, 1u);
  EXPECT_EQ(comm_of(r, "test-a")->members, (std::vector<int>{0, 1}));
  ASSERT_GE(r.ops.size(), 4u);
  const Op& last = r.ops.back();  // newest last
  EXPECT_EQ(last.comm, "test-b");
  EXPECT_EQ(last.kind, "all_gather");
  EXPECT_LT(last.done_ago, 0);
  const Op& send = r.ops[r.ops.size() - 2];
  EXPECT_TRUE(send.p2p);
  EXPECT_GE(send.done_ago, 0);
  EXPECT_EQ(split_label(a, 3), "test-a/1c3");
  EXPECT_EQ(split_label(a, 0), "test-a/2c0");

  for (int i = 0; i < kRing + 10; ++i) complete(issue(b, "barrier", 0));
  r = snapshot(0, {});
  ASSERT_EQ(r.ops.size(), static_cast<size_t>(kRing));
  EXPECT_EQ(r.ops.front().seq, 12u);  // all_gather #1, then barriers #2.., the first 11 gone
  EXPECT_EQ(r.ops.back().seq, static_cast<uint64_t>(kRing + 11));
  EXPECT_EQ(comm_of(r, "test-b")->completed, static_cast<uint64_t>(kRing + 11));
}

TEST(Flight, TheSideChannelFormReadsBack) {
  Report r;
  r.rank = 2;
  r.host = "n1";
  r.pid = 1234;
  r.comms = {{"world", 7, 6, {0, 1, 2, 3}}, {"nccl world/1c0", 1, 1, {}}};
  r.ops = {{"world", "all_reduce", 7, 8, 1.5, -1, false}, {"world", "recv", 2, 64, 0.25, 0.125, true}};
  r.waits = {{"all_reduce", 8, 1.5}};
  const Report back = parse(serialize(r));
  EXPECT_EQ(back.rank, 2);
  EXPECT_EQ(back.host, "n1");
  EXPECT_EQ(back.pid, 1234);
  ASSERT_EQ(back.comms.size(), 2u);
  EXPECT_EQ(back.comms[0].members, (std::vector<int>{0, 1, 2, 3}));
  EXPECT_TRUE(back.comms[1].members.empty());
  ASSERT_EQ(back.ops.size(), 2u);
  EXPECT_EQ(back.ops[0].seq, 7u);
  EXPECT_LT(back.ops[0].done_ago, 0);
  EXPECT_TRUE(back.ops[1].p2p);
  EXPECT_DOUBLE_EQ(back.ops[1].done_ago, 0.125);
  ASSERT_EQ(back.waits.size(), 1u);
  EXPECT_EQ(back.waits[0].what, "all_reduce");
  EXPECT_THROW(parse("not a record"), Error);
  EXPECT_THROW(parse("R\t1\th\t2\nO\tworld\tx\n"), Error);
  EXPECT_NE(to_json(r).find("\"format\": \"dtk-flight\""), std::string::npos);
}

// Rank r of 4, waiting in world's all_reduce #seq (or done with everything before it).
Report waiting_rank(int r, uint64_t seq) {
  Report x;
  x.rank = r;
  x.comms = {{"world", seq, seq - 1, {0, 1, 2, 3}}, {"runtime", 2, 2, {0, 1, 2, 3}}};
  x.ops = {{"world", "all_reduce", seq - 1, 8, 0.4, 0.39, false}, {"world", "all_reduce", seq, 8, 5.1, -1, false}};
  x.waits = {{"all_reduce", 8, 5.1}};
  return x;
}

TEST(Flight, DiagnosisNamesASilentRank) {
  const std::string line = diagnose({waiting_rank(0, 1234), waiting_rank(1, 1234), waiting_rank(3, 1234)}, {2}, {},
                                    4, 5.0);
  EXPECT_EQ(line,
            "collective timeout (5.0 s): rank 2 never reached all_reduce #1234 (8 B, world), where 3 of 4 ranks "
            "wait; it does not answer (stopped, or its process is hung); the collective before on world was "
            "all_reduce #1233 (8 B)");
}

TEST(Flight, DiagnosisSaysWhereAnAnsweringCulpritIs) {
  Report elsewhere;  // rank 1 went on to the exit-code agreement
  elsewhere.rank = 1;
  elsewhere.comms = {{"world", 1233, 1233, {0, 1, 2, 3}}, {"runtime", 3, 2, {0, 1, 2, 3}}};
  elsewhere.ops = {{"world", "all_reduce", 1233, 8, 9, 8.9, false},
                   {"runtime", "exit-code agreement", 3, 4, 7.3, -1, false}};
  elsewhere.waits = {{"exit-code agreement", 4, 7.3}};
  Report idle;  // rank 3 computes, its last collective long done
  idle.rank = 3;
  idle.comms = {{"world", 1233, 1233, {0, 1, 2, 3}}};
  idle.ops = {{"world", "all_reduce", 1233, 8, 61.5, 61.0, false}};
  const std::string line = diagnose({waiting_rank(0, 1234), elsewhere, waiting_rank(2, 1234), idle}, {}, {}, 4, 5);
  EXPECT_EQ(line,
            "collective timeout (5.0 s): ranks 1, 3 never reached all_reduce #1234 (8 B, world), where 2 of 4 ranks "
            "wait; rank 1 is waiting in exit-code agreement #3 (4 B, runtime) for 7.3 s; rank 3 is not waiting in a "
            "collective; its last, all_reduce #1233 (8 B, world), completed 61.0 s ago");
}

TEST(Flight, DiagnosisOfAnExitedRankAndOfACollectiveEveryoneReached) {
  EXPECT_EQ(diagnose({waiting_rank(0, 9), waiting_rank(2, 9), waiting_rank(3, 9)}, {}, {1}, 4, 2),
            "collective timeout (2.0 s): rank 1 never reached all_reduce #9 (8 B, world), where 3 of 4 ranks wait; "
            "it has exited (its process is gone)");
  EXPECT_EQ(diagnose({waiting_rank(0, 9), waiting_rank(1, 9)}, {}, {}, 2, 2),
            "collective timeout (2.0 s): every rank of world reached all_reduce #9 (8 B, world) and it did not "
            "complete; a broken network, or a step longer than --comm-timeout");
}

TEST(Flight, DiagnosisOfARankStoppedInsideACollective) {
  // Rank 2 stopped inside all_reduce #16 after its part reached ranks 1 and 3 (recursive
  // doubling), which completed it and wait in #17; rank 0 still waits in #16.
  Report ahead1 = waiting_rank(1, 17), ahead3 = waiting_rank(3, 17), behind = waiting_rank(0, 16);
  for (Report* r : {&ahead1, &ahead3, &behind}) r->ops.front().bytes = r->ops.back().bytes = 24;
  EXPECT_EQ(diagnose({behind, ahead1, ahead3}, {2}, {}, 4, 3),
            "collective timeout (3.0 s): all_reduce #16 (24 B, world) did not complete on 1 of 4 ranks (2 "
            "completed it); rank 2 does not answer (stopped, or its process is hung)");
}

TEST(Flight, NoDiagnosisWithoutAnOpenCollective) {
  Report gpu;  // waits for the GPU, no collective open
  gpu.rank = 0;
  gpu.comms = {{"world", 3, 3, {0, 1}}};
  gpu.ops = {{"world", "all_reduce", 3, 8, 2, 1.9, false}};
  gpu.waits = {{"a wait for the GPU", 0, 5}};
  EXPECT_EQ(diagnose({gpu}, {1}, {}, 2, 5), "");
  // A rank blocked in a receive is not a collective the others must reach.
  Report recv = gpu;
  recv.ops.push_back({"world", "recv", 1, 64, 5, -1, true});
  EXPECT_EQ(diagnose({recv}, {1}, {}, 2, 5), "");
}

TEST(Flight, MembersUnknownAreTheRanksThatHaveTheCommunicator) {
  Report a = waiting_rank(0, 4), b = waiting_rank(1, 3);
  for (Report* r : {&a, &b})
    for (Comm& c : r->comms) c.members.clear();
  b.waits.clear();
  b.ops = {{"world", "all_reduce", 3, 8, 2, 1.5, false}};
  b.comms[0].completed = 3;
  EXPECT_EQ(diagnose({a, b}, {}, {}, 2, 1),
            "collective timeout (1.0 s): rank 1 never reached all_reduce #4 (8 B, world), where 1 of 2 ranks wait; "
            "it is not waiting in a collective; its last, all_reduce #3 (8 B, world), completed 1.5 s ago");
}

}  // namespace
}  // namespace dtk::comm::flight
