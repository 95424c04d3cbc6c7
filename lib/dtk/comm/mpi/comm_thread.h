// The MPI backend's communication thread (internal to comm/mpi).
// The communication thread. MPI's nonblocking collectives progress only inside MPI calls, so an
// all-reduce started before a backward pass would mostly wait for the next MPI call. Instead,
// async operations on host buffers are queued to one thread per communicator that owns them, the
// CPU counterpart of a GPU's communication stream: it runs them one at a time in program order,
// starting each and driving it with MPI_Test, yielding the core (sched_yield) between tests so
// that a busy compute thread keeps it, while an idle core lets it run at full speed. Completion
// reaches the caller through the Work handle. A sync operation first waits for the queue to
// empty, then runs on the caller's thread: program order holds on every rank, and small blocking
// collectives keep their latency. The thread needs MPI_THREAD_MULTIPLE; without it, or with
// DTK_COMM_THREAD=0, for device buffers, and for a lone send or receive (its peer operation on
// this rank may be queued behind it), async operations are MPI's nonblocking calls as they are,
// progressed by Work::test and wait.
#pragma once
#include <mpi.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "dtk/comm/comm.h"
#include "dtk/comm/watchdog.h"
#include "dtk/core/error.h"

namespace dtk::comm {

class CommThread {
 public:
  struct Op final : Work::State {
    std::function<void()> body;
    const char* what = "";
    size_t bytes = 0;
    CommThread* owner = nullptr;
    std::atomic<bool> done{false};
    std::string error;  // written before done when the body failed

    bool test() override {
      if (!done.load(std::memory_order_acquire)) return false;
      rethrow();
      return true;
    }
    void wait() override {
      if (!done.load(std::memory_order_acquire)) {
        watchdog::Scope scope(what, bytes);
        std::unique_lock lock(owner->mu_);
        owner->done_cv_.wait(lock, [this] { return done.load(std::memory_order_acquire); });
      }
      rethrow();
    }
    void rethrow() {
      if (error.empty()) return;
      std::string e = std::move(error);
      error.clear();
      fail(e);
    }
  };

  ~CommThread() {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    work_cv_.notify_one();
    if (thread_.joinable()) thread_.join();
  }

  std::shared_ptr<Op> submit(const char* what, size_t bytes, std::function<void()> body) {
    auto op = std::make_shared<Op>();
    op->body = std::move(body);
    op->what = what;
    op->bytes = bytes;
    op->owner = this;
    {
      std::lock_guard lock(mu_);
      if (!thread_.joinable()) thread_ = std::thread([this] { loop(); });
      queue_.push_back(op);
      ++pending_;
    }
    work_cv_.notify_one();
    return op;
  }

  // Returns once every submitted operation has completed.
  void drain(const char* what, size_t bytes) {
    std::unique_lock lock(mu_);
    if (pending_ == 0) return;
    watchdog::Scope scope(what, bytes);
    done_cv_.wait(lock, [this] { return pending_ == 0; });
  }

 private:
  void loop() {
    for (;;) {
      std::shared_ptr<Op> op;
      {
        std::unique_lock lock(mu_);
        work_cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopping, nothing left
        op = std::move(queue_.front());
        queue_.pop_front();
      }
      try {
        op->body();
      } catch (const std::exception& e) {
        op->error = e.what();
      }
      op->body = nullptr;  // release the staging buffers before the caller sees completion
      {
        std::lock_guard lock(mu_);
        op->done.store(true, std::memory_order_release);
        --pending_;
      }
      done_cv_.notify_all();
    }
  }

  std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  std::deque<std::shared_ptr<Op>> queue_;
  size_t pending_ = 0;  // queued or running
  bool stop_ = false;
  std::thread thread_;
};

// The thread is used: MPI_THREAD_MULTIPLE, and DTK_COMM_THREAD is not 0.
bool comm_thread_wanted();

}  // namespace dtk::comm
