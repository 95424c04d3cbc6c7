// The flight recorder and the diagnosis of a collective timeout (flight.h).
#include "dtk/comm/flight.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "dtk/core/error.h"

namespace dtk::comm::flight {
namespace {

long long now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

struct Rec {
  int comm = -1;
  uint64_t seq = 0;
  const char* kind = "";
  uint64_t bytes = 0;
  long long issued_ns = 0, done_ns = 0;
  bool p2p = false;
};
struct CommState {
  std::string label;
  std::vector<int> members;
  uint64_t issued = 0, completed = 0, p2p = 0;
  int splits = 0;
};

std::mutex g_mu;
std::deque<CommState> g_comms;  // by id; a deque keeps references stable
Rec g_ring[kRing];
uint64_t g_recorded = 0;  // operations recorded; the newest is g_ring[(g_recorded - 1) % kRing]

std::string clean(std::string s) {  // no tabs or newlines in a field of the side channel's form
  std::replace(s.begin(), s.end(), '\t', ' ');
  std::replace(s.begin(), s.end(), '\n', ' ');
  return s;
}

std::string size_text(uint64_t b) {
  if (b < 1024) return fmt::format("{} B", b);
  if (b < (1u << 20)) return fmt::format("{:.1f} KiB", b / 1024.0);
  if (b < (1u << 30)) return fmt::format("{:.1f} MiB", b / 1048576.0);
  return fmt::format("{:.2f} GiB", b / 1073741824.0);
}

std::string rank_list(const std::vector<int>& ranks) {
  constexpr size_t kShown = 8;
  std::string s;
  for (size_t i = 0; i < ranks.size() && i < kShown; ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  if (ranks.size() > kShown) s += fmt::format(" and {} more", ranks.size() - kShown);
  return s;
}

const Comm* find_comm(const Report& r, const std::string& label) {
  for (const Comm& c : r.comms)
    if (c.label == label) return &c;
  return nullptr;
}

// The oldest operation that rank r has issued and not completed (what it is blocked in), or
// null; point-to-point ones only when `p2p`.
const Op* oldest_open(const Report& r, bool p2p) {
  const Op* best = nullptr;
  for (const Op& o : r.ops)
    if (o.done_ago < 0 && (p2p || !o.p2p) && (!best || o.issued_ago > best->issued_ago)) best = &o;
  return best;
}

std::string op_text(const std::string& kind, uint64_t seq, uint64_t bytes, const std::string& comm, bool p2p = false) {
  return fmt::format("{} #{} ({}, {}{})", kind, seq, size_text(bytes), comm, p2p ? ", point-to-point" : "");
}

}  // namespace

int enrol(const std::string& label, std::vector<int> members) {
  std::lock_guard lock(g_mu);
  g_comms.push_back({label, std::move(members)});
  return static_cast<int>(g_comms.size()) - 1;
}

std::string split_label(int parent, int color) {
  std::lock_guard lock(g_mu);
  if (parent < 0 || parent >= static_cast<int>(g_comms.size())) return fmt::format("split c{}", color);
  CommState& p = g_comms[parent];
  return fmt::format("{}/{}c{}", p.label, ++p.splits, color);
}

Ticket issue(int comm, const char* kind, size_t bytes, bool p2p) {
  const long long t = now_ns();
  std::lock_guard lock(g_mu);
  if (comm < 0 || comm >= static_cast<int>(g_comms.size())) return {};
  CommState& c = g_comms[comm];
  const uint64_t seq = p2p ? ++c.p2p : ++c.issued;
  g_ring[g_recorded++ % kRing] = {comm, seq, kind, bytes, t, 0, p2p};
  return {comm, seq, p2p};
}

void complete(Ticket t) {
  if (t.comm < 0) return;
  const long long now = now_ns();
  std::lock_guard lock(g_mu);
  CommState& c = g_comms[t.comm];
  if (!t.p2p) c.completed = std::max(c.completed, t.seq);
  const uint64_t n = std::min<uint64_t>(g_recorded, kRing);
  for (uint64_t i = 1; i <= n; ++i) {  // newest first: the operation is usually among the last few
    Rec& r = g_ring[(g_recorded - i) % kRing];
    if (r.comm == t.comm && r.seq == t.seq && r.p2p == t.p2p) {
      r.done_ns = now;
      return;
    }
  }
}

Report snapshot(int rank, std::vector<Wait> waits) {
  Report out;
  out.rank = rank;
  char host[256] = {0};
  gethostname(host, sizeof host - 1);
  out.host = host;
  out.pid = static_cast<long>(getpid());
  out.waits = std::move(waits);
  const long long now = now_ns();
  std::lock_guard lock(g_mu);
  for (const CommState& c : g_comms) out.comms.push_back({c.label, c.issued, c.completed, c.members});
  const uint64_t n = std::min<uint64_t>(g_recorded, kRing);
  for (uint64_t i = n; i >= 1; --i) {
    const Rec& r = g_ring[(g_recorded - i) % kRing];
    out.ops.push_back({g_comms[r.comm].label, r.kind, r.seq, r.bytes, (now - r.issued_ns) / 1e9,
                       r.done_ns ? (now - r.done_ns) / 1e9 : -1.0, r.p2p});
  }
  return out;
}

std::string serialize(const Report& r) {
  std::string s = fmt::format("R\t{}\t{}\t{}\n", r.rank, clean(r.host), r.pid);
  for (const Comm& c : r.comms) {
    std::string m;
    for (size_t i = 0; i < c.members.size(); ++i) m += (i ? "," : "") + std::to_string(c.members[i]);
    s += fmt::format("C\t{}\t{}\t{}\t{}\n", clean(c.label), c.issued, c.completed, m.empty() ? "-" : m);
  }
  for (const Op& o : r.ops)
    s += fmt::format("O\t{}\t{}\t{}\t{}\t{:.6f}\t{:.6f}\t{}\n", clean(o.comm), o.seq, clean(o.kind), o.bytes,
                     o.issued_ago, o.done_ago, o.p2p ? 1 : 0);
  for (const Wait& w : r.waits) s += fmt::format("W\t{}\t{}\t{:.6f}\n", clean(w.what), w.bytes, w.for_s);
  return s;
}

Report parse(const std::string& text) {
  Report r;
  std::istringstream in(text);
  std::string line;
  bool head = false;
  while (std::getline(in, line)) {
    std::vector<std::string> f;
    std::string field;
    std::istringstream fs(line);
    while (std::getline(fs, field, '\t')) f.push_back(field);
    try {
      if (f.size() == 4 && f[0] == "R") {
        r.rank = std::stoi(f[1]);
        r.host = f[2];
        r.pid = std::stol(f[3]);
        head = true;
      } else if (f.size() == 5 && f[0] == "C") {
        Comm c{f[1], std::stoull(f[2]), std::stoull(f[3]), {}};
        if (f[4] != "-") {
          std::istringstream ms(f[4]);
          for (std::string m; std::getline(ms, m, ',');) c.members.push_back(std::stoi(m));
        }
        r.comms.push_back(std::move(c));
      } else if (f.size() == 8 && f[0] == "O") {
        r.ops.push_back(
            {f[1], f[3], std::stoull(f[2]), std::stoull(f[4]), std::stod(f[5]), std::stod(f[6]), f[7] == "1"});
      } else if (f.size() == 4 && f[0] == "W") {
        r.waits.push_back({f[1], std::stoull(f[2]), std::stod(f[3])});
      } else {
        fail("flight record: unreadable line '{}'", line);
      }
    } catch (const std::logic_error&) {  // stoi and friends
      fail("flight record: unreadable line '{}'", line);
    }
  }
  if (!head) fail("flight record: no header line");
  return r;
}

std::string to_json(const Report& r) {
  nlohmann::json j;
  j["format"] = "dtk-flight";
  j["version"] = 1;
  j["rank"] = r.rank;
  j["host"] = r.host;
  j["pid"] = r.pid;
  j["communicators"] = nlohmann::json::array();
  for (const Comm& c : r.comms)
    j["communicators"].push_back({{"label", c.label}, {"issued", c.issued}, {"completed", c.completed},
                                  {"members", c.members}});
  j["operations"] = nlohmann::json::array();
  for (const Op& o : r.ops) {
    nlohmann::json op = {{"communicator", o.comm}, {"seq", o.seq}, {"kind", o.kind}, {"bytes", o.bytes},
                         {"issued_s_ago", o.issued_ago}, {"point_to_point", o.p2p}};
    op["completed_s_ago"] = o.done_ago < 0 ? nlohmann::json() : nlohmann::json(o.done_ago);
    j["operations"].push_back(op);
  }
  j["waits"] = nlohmann::json::array();
  for (const Wait& w : r.waits) j["waits"].push_back({{"what", w.what}, {"bytes", w.bytes}, {"for_s", w.for_s}});
  return j.dump(1) + "\n";
}

std::string diagnose(const std::vector<Report>& answered, const std::vector<int>& silent,
                     const std::vector<int>& exited, int world_size, double timeout_s) {
  // The collective that blocks: the communicator that most waiting ranks are blocked on (the
  // oldest open collective of each; ties: the longest wait), and there the lowest number among
  // them (what program order waits for: a rank ahead completed what the others wait in).
  std::map<std::string, std::pair<const Op*, int>> lowest;  // communicator -> (lowest, waiting ranks)
  for (const Report& r : answered) {
    if (r.waits.empty()) continue;
    if (const Op* o = oldest_open(r, false)) {
      auto& [l, n] = lowest[o->comm];
      ++n;
      if (!l || o->seq < l->seq || (o->seq == l->seq && o->issued_ago > l->issued_ago)) l = o;
    }
  }
  if (lowest.empty()) return "";
  const Op* target = nullptr;
  int most = 0;
  for (const auto& [label, on] : lowest)
    if (!target || on.second > most || (on.second == most && on.first->issued_ago > target->issued_ago)) {
      target = on.first;
      most = on.second;
    }
  const std::string label = target->comm;
  const uint64_t seq = target->seq;

  // Its members: as any report knows them; otherwise every rank that has the communicator or
  // did not answer.
  std::vector<int> members;
  for (const Report& r : answered)
    if (const Comm* c = find_comm(r, label); c && !c->members.empty()) members = c->members;
  if (members.empty()) {
    std::set<int> m(silent.begin(), silent.end());
    m.insert(exited.begin(), exited.end());
    for (const Report& r : answered)
      if (find_comm(r, label)) m.insert(r.rank);
    members.assign(m.begin(), m.end());
  }
  std::map<int, const Report*> by_rank;
  for (const Report& r : answered) by_rank[r.rank] = &r;
  const std::set<int> silent_set(silent.begin(), silent.end()), exited_set(exited.begin(), exited.end());

  // Which answering members wait in it, and which completed it already (then every member
  // reached it: a rank completes a collective only with every member's part).
  int waiters = 0, completed = 0;
  for (int m : members) {
    auto it = by_rank.find(m);
    if (it == by_rank.end()) continue;
    const Report& r = *it->second;
    const Comm* c = find_comm(r, label);
    if (c && c->completed >= seq) {
      ++completed;
    } else if (!r.waits.empty() && c && c->issued >= seq) {
      ++waiters;
    }
  }

  // The previous operation of the communicator, as a waiting rank recorded it.
  std::string previous;
  for (const Report& r : answered)
    for (const Op& o : r.ops)
      if (o.comm == label && !o.p2p && o.seq + 1 == seq) previous = fmt::format("{} #{} ({})", o.kind, o.seq, size_text(o.bytes));

  std::vector<int> culprits;
  std::vector<std::string> where;
  for (int m : members) {
    std::string w;
    if (exited_set.count(m)) {
      w = "has exited (its process is gone)";
    } else if (silent_set.count(m)) {
      w = "does not answer (stopped, or its process is hung)";
      if (!previous.empty() && completed == 0)
        w += fmt::format("; the collective before on {} was {}", label, previous);
    } else if (auto it = by_rank.find(m); it != by_rank.end()) {
      const Report& r = *it->second;
      const Comm* c = find_comm(r, label);
      if (c && c->issued >= seq) continue;  // it reached the collective
      if (!r.waits.empty()) {
        const Wait& longest = *std::max_element(r.waits.begin(), r.waits.end(),
                                                [](const Wait& a, const Wait& b) { return a.for_s < b.for_s; });
        if (const Op* o = oldest_open(r, true))
          w = fmt::format("is waiting in {} for {:.1f} s", op_text(o->kind, o->seq, o->bytes, o->comm, o->p2p),
                          longest.for_s);
        else
          w = fmt::format("is waiting in {} for {:.1f} s", longest.what, longest.for_s);
      } else if (!r.ops.empty()) {
        const Op& last = r.ops.back();
        w = last.done_ago < 0
                ? fmt::format("is not waiting in a collective; its last, {}, was issued {:.1f} s ago",
                              op_text(last.kind, last.seq, last.bytes, last.comm, last.p2p), last.issued_ago)
                : fmt::format("is not waiting in a collective; its last, {}, completed {:.1f} s ago",
                              op_text(last.kind, last.seq, last.bytes, last.comm, last.p2p), last.done_ago);
      } else {
        w = "has issued no collective yet";
      }
    } else {
      continue;  // a member no report mentions (outside the world?): nothing to say
    }
    culprits.push_back(m);
    where.push_back(std::move(w));
  }

  const std::string target_text = op_text(target->kind, seq, target->bytes, label);
  if (culprits.empty())
    return fmt::format("collective timeout ({:.1f} s): every rank of {} reached {} and it did not complete{}; a "
                       "broken network, or a step longer than --comm-timeout",
                       timeout_s, label, target_text,
                       completed ? fmt::format(" on {} of {} ranks", waiters, world_size) : std::string());
  std::string line;
  if (completed) {  // every member reached it; some completed it, the culprits hold the others back
    line = fmt::format("collective timeout ({:.1f} s): {} did not complete on {} of {} ranks ({} completed it)",
                       timeout_s, target_text, waiters, world_size, completed);
    constexpr size_t kShown = 8;
    for (size_t i = 0; i < culprits.size() && i < kShown; ++i)
      line += fmt::format("; rank {} {}", culprits[i], where[i]);
  } else if (culprits.size() == 1) {
    line = fmt::format("collective timeout ({:.1f} s): rank {} never reached {}, where {} of {} ranks wait; it {}",
                       timeout_s, culprits[0], target_text, waiters, world_size, where[0]);
  } else {
    line = fmt::format("collective timeout ({:.1f} s): ranks {} never reached {}, where {} of {} ranks wait",
                       timeout_s, rank_list(culprits), target_text, waiters, world_size);
    constexpr size_t kShown = 8;
    for (size_t i = 0; i < culprits.size() && i < kShown; ++i)
      line += fmt::format("; rank {} {}", culprits[i], where[i]);
  }
  return line;
}

}  // namespace dtk::comm::flight
