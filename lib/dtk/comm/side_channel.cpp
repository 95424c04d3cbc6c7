// The watchdog's side channel (side_channel.h): plain POSIX sockets, one server thread.
#include "dtk/comm/side_channel.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <mutex>
#include <thread>

namespace dtk::comm::side {
namespace {

int g_listen = -1;
int g_wake[2] = {-1, -1};  // a pipe: stop() wakes the server thread through it
std::thread g_server;
Handler g_handler = nullptr;
std::mutex g_peers_mu;
std::vector<sockaddr_in> g_addr;  // sin_port 0: unreachable
std::atomic<bool> g_ready{false};
std::atomic<bool> g_leaving{false}, g_released{false};  // leave_together

// One request: read kind + body until the client's end of input (1 s at most), answer, close.
void serve_one(int fd) {
  timeval tv{1, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  std::string in;
  char buf[4096];
  for (;;) {
    const ssize_t n = recv(fd, buf, sizeof buf, 0);
    if (n > 0) {
      in.append(buf, static_cast<size_t>(n));
      if (in.size() > (1u << 20)) break;
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    break;
  }
  if (!in.empty()) {
    std::string out;
    if (in[0] == 'L') {
      out = g_leaving ? "1" : "0";
    } else if (in[0] == 'R') {
      g_released = true;
      out = "k";
    } else if (g_handler) {
      out = g_handler(in[0], in.substr(1));
    }
    size_t sent = 0;
    while (sent < out.size()) {
      const ssize_t n = send(fd, out.data() + sent, out.size() - sent, MSG_NOSIGNAL);
      if (n > 0) {
        sent += static_cast<size_t>(n);
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      break;
    }
  }
  close(fd);
}

void serve() {
  for (;;) {
    pollfd p[2] = {{g_listen, POLLIN, 0}, {g_wake[0], POLLIN, 0}};
    if (poll(p, 2, -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (p[1].revents) return;
    if (p[0].revents & POLLIN) {
      const int fd = accept4(g_listen, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd >= 0) serve_one(fd);
    }
  }
}

sockaddr_in address_of(const std::string& host, int port, const std::string& my_host) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  if (port <= 0) return a;
  if (host == my_host) {
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  } else {
    addrinfo hints{}, *res = nullptr;
    hints.ai_family = AF_INET;
    hints.ai_socktype = SOCK_STREAM;
    if (getaddrinfo(host.c_str(), nullptr, &hints, &res) != 0 || !res) return a;
    a.sin_addr = reinterpret_cast<sockaddr_in*>(res->ai_addr)->sin_addr;
    freeaddrinfo(res);
  }
  a.sin_port = htons(static_cast<uint16_t>(port));
  return a;
}

}  // namespace

int listen(Handler handler) {
  if (g_listen >= 0) return -1;
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_ANY);
  a.sin_port = 0;
  socklen_t len = sizeof a;
  if (bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || ::listen(fd, 128) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0 || pipe2(g_wake, O_CLOEXEC) != 0) {
    close(fd);
    return -1;
  }
  g_listen = fd;
  g_handler = handler;
  g_server = std::thread(serve);
  return ntohs(a.sin_port);
}

void set_peers(const std::vector<std::string>& hosts, const std::vector<int>& ports, int my_rank) {
  std::vector<sockaddr_in> addr;
  const std::string& mine = hosts.at(static_cast<size_t>(my_rank));
  for (size_t r = 0; r < hosts.size(); ++r) addr.push_back(address_of(hosts[r], ports[r], mine));
  std::lock_guard lock(g_peers_mu);
  g_addr = std::move(addr);
  g_ready = g_listen >= 0;
}

bool ready() { return g_ready.load(); }

void stop() {
  g_ready = false;
  if (g_listen < 0) return;
  const char c = 0;
  if (write(g_wake[1], &c, 1) < 0) {}  // the thread returns on any readiness
  if (g_server.joinable()) g_server.join();
  close(g_listen);
  close(g_wake[0]);
  close(g_wake[1]);
  g_listen = g_wake[0] = g_wake[1] = -1;
}

std::vector<Reply> ask(const std::vector<int>& ranks, char kind, const std::string& body, double deadline_s) {
  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + std::chrono::duration<double>(deadline_s);
  struct Conn {
    int fd = -1;
    bool connected = false, done = false;
    std::string out;
    size_t sent = 0;
  };
  std::vector<Reply> replies(ranks.size());
  std::vector<Conn> conns(ranks.size());
  std::vector<sockaddr_in> addr;
  {
    std::lock_guard lock(g_peers_mu);
    addr = g_addr;
  }
  const std::string message = kind ? std::string(1, kind) + body : std::string();
  for (size_t i = 0; i < ranks.size(); ++i) {
    Conn& c = conns[i];
    c.out = message;
    const int r = ranks[i];
    if (r < 0 || static_cast<size_t>(r) >= addr.size() || addr[r].sin_port == 0) {
      c.done = true;  // not reachable: silent
      continue;
    }
    c.fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (c.fd < 0) {
      c.done = true;
      continue;
    }
    if (connect(c.fd, reinterpret_cast<const sockaddr*>(&addr[r]), sizeof(sockaddr_in)) == 0) {
      c.connected = true;
    } else if (errno == ECONNREFUSED) {
      replies[i].state = State::exited;
      c.done = true;
    } else if (errno != EINPROGRESS) {
      c.done = true;
    }
  }
  const auto finish = [&](size_t i, State s) {
    replies[i].state = s;
    conns[i].done = true;
  };
  for (;;) {
    std::vector<pollfd> p;
    std::vector<size_t> which;
    for (size_t i = 0; i < conns.size(); ++i) {
      Conn& c = conns[i];
      if (c.done) continue;
      if (c.connected && kind == 0) {
        finish(i, State::answered);
        continue;
      }
      short events = !c.connected || c.sent < c.out.size() ? POLLOUT : POLLIN;
      p.push_back({c.fd, events, 0});
      which.push_back(i);
    }
    if (p.empty()) break;
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) break;
    const int n = poll(p.data(), p.size(), static_cast<int>(left));
    if (n < 0 && errno != EINTR) break;
    for (size_t k = 0; k < p.size(); ++k) {
      if (!p[k].revents) continue;
      const size_t i = which[k];
      Conn& c = conns[i];
      if (!c.connected) {
        int err = 0;
        socklen_t len = sizeof err;
        getsockopt(c.fd, SOL_SOCKET, SO_ERROR, &err, &len);
        if (err == 0) {
          c.connected = true;
        } else {
          finish(i, err == ECONNREFUSED ? State::exited : State::silent);
        }
        continue;
      }
      if (c.sent < c.out.size()) {
        const ssize_t w = send(c.fd, c.out.data() + c.sent, c.out.size() - c.sent, MSG_NOSIGNAL);
        if (w > 0) c.sent += static_cast<size_t>(w);
        else if (w < 0 && errno != EAGAIN && errno != EINTR) finish(i, errno == ECONNRESET || errno == EPIPE ? State::exited : State::silent);
        if (c.sent == c.out.size()) shutdown(c.fd, SHUT_WR);  // the end of the request
        continue;
      }
      char buf[4096];
      const ssize_t got = recv(c.fd, buf, sizeof buf, 0);
      if (got > 0) {
        replies[i].body.append(buf, static_cast<size_t>(got));
      } else if (got == 0) {
        finish(i, State::answered);
      } else if (errno != EAGAIN && errno != EINTR) {
        finish(i, errno == ECONNRESET ? State::exited : State::silent);
      }
    }
  }
  for (size_t i = 0; i < conns.size(); ++i) {
    if (conns[i].fd >= 0) close(conns[i].fd);
    if (!conns[i].done) replies[i].state = State::silent;
    if (replies[i].state != State::answered) replies[i].body.clear();
  }
  return replies;
}

void leave_together(int rank, int size, double deadline_s) {
  using Clock = std::chrono::steady_clock;
  g_leaving = true;
  if (!ready() || size < 2) return;
  const auto deadline = Clock::now() + std::chrono::duration<double>(deadline_s);
  const auto left_s = [&] { return std::chrono::duration<double>(deadline - Clock::now()).count(); };
  if (rank != 0) {
    for (int i = 1; !g_released && left_s() > 0; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      if (i % 100 == 0 && ask({0}, 0, "", 0.2)[0].state == State::exited) return;
    }
    return;
  }
  std::vector<int> others, waiting;
  for (int r = 1; r < size; ++r) others.push_back(r);
  waiting = others;
  while (!waiting.empty() && left_s() > 0) {
    const std::vector<Reply> replies = ask(waiting, 'L', "", std::min(left_s(), 0.5));
    std::vector<int> still;  // neither there yet nor gone
    for (size_t i = 0; i < waiting.size(); ++i)
      if (replies[i].state != State::exited && replies[i].body != "1") still.push_back(waiting[i]);
    waiting.swap(still);
    if (!waiting.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  ask(others, 'R', "", 0.5);
}

}  // namespace dtk::comm::side
