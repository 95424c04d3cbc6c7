// The watchdog's side channel: a TCP socket per process, opened at start-up beside MPI, on which
// a thread of its own answers the other ranks even while the process's other threads are blocked
// inside MPI (or NCCL, or the GPU). Requests are one byte of kind and a body; the answer is the
// handler's text; every request has a deadline, so a rank that is stopped (SIGSTOP) or hung
// answers nothing in time (silent) and a rank whose process is gone refuses the connection
// (exited) at once. Why TCP and not MPI: docs/DESIGN.md, "Communication beside computation".
#pragma once
#include <string>
#include <vector>

namespace dtk::comm::side {

// Called on the server thread for each request; returns the answer.
using Handler = std::string (*)(char kind, const std::string& body);

// Listens on every address of this host, on a port the system picks, and starts the server
// thread. Returns the port, or -1 (with nothing started) when no socket can be opened.
int listen(Handler handler);
// Where every rank listens (ranks[i] on hosts[i]:ports[i]; port -1: none). A rank on this host
// is reached on 127.0.0.1; another host by its name, resolved now.
void set_peers(const std::vector<std::string>& hosts, const std::vector<int>& ports, int my_rank);
bool ready();  // set_peers was called with this rank listening
// Stops the server thread and closes the socket (the process's end).
void stop();

// The end of a job that exits with a non-zero status, after MPI_Finalize (comm::Runtime::finish):
// returns once every rank has called it (rank 0 asks the others until they all have, then
// releases them), after `deadline_s`, or as soon as rank 0's process is gone. At once without a
// side channel. The channel answers its own kinds 'L' (has this rank called it?) and 'R' (release).
void leave_together(int rank, int size, double deadline_s);

enum class State { answered, silent, exited };
struct Reply {
  State state = State::silent;
  std::string body;
};
// Sends (kind, body) to each of `ranks` at once and collects the answers until they are all in
// or `deadline_s` has passed. kind 0 only connects: answered means the rank's process is there.
std::vector<Reply> ask(const std::vector<int>& ranks, char kind, const std::string& body, double deadline_s);

}  // namespace dtk::comm::side
