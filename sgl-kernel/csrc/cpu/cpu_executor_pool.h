// Persistent worker pool of the CPU executor (paper §4.1, "Graph-resident
// CPU execution": "The workers themselves form a persistent C++ pool pinned to
// physical cores").
//
// * Threads are created on first use, by default one per physical core of the
//   process's CPU affinity set but one (sysfs topology; without it, one per
//   allowed CPU; at least one), and pinned one per core with sched_setaffinity,
//   the first core left free (a failed pin is reported by info(), never an
//   error; SGLANG_CPU_EXPERT_PIN=0 skips pinning). No thread is ever created
//   per call.
// * The thread that waits on a handle works too: it takes items of the running
//   job (any handle's: FIFO puts every earlier job ahead of its own) until they
//   are handed out, so with the default count every core streams during a job
//   and none spins beside a worker, and a job of a few items starts at once
//   instead of after a sleeping worker's wake-up.
// * A job is a list of work items taken from one atomic counter by every pool
//   thread that finds the job current (ItemJob). The thread that completes the
//   last item retires the job and starts the next, so a thread the OS keeps off
//   its core delays a job only by the item it holds, never by checking in late.
//   Jobs run one after another in submission order (FIFO), so the jobs of one
//   submit() may share scratch memory.
// * Idle threads spin (SGLANG_CPU_EXPERT_SPIN_US, default 300 us) on an
//   atomic generation counter, then sleep on a condition variable; waiters do
//   the same on the job's completion flag.
// * A forked child does not inherit the threads: the first use in the child
//   builds a new pool (the parent's pool state is abandoned, never touched).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace sglk {

class PoolJob {
 public:
  virtual ~PoolJob() = default;
  // Called by each pool thread that finds the job current (possibly late, after
  // the job completed). Returns true on the one call that completed the job.
  virtual bool run(int worker) = 0;
  // Records the first error (reported by ExpertPool::wait's caller).
  void set_error(const std::string& msg);
  std::string error();
  // Drops what the job holds of its caller (tensors). Called by the waiting
  // thread once the job is complete, never by a pool thread: a pool thread may
  // hold the last reference to the job object itself, and freeing a tensor
  // that has a Python object takes the GIL (fatal in a pool thread during
  // interpreter shutdown, and a stall otherwise).
  virtual void release() {}

 private:
  friend class ExpertPool;
  std::atomic<int> done_{0};  // completed and retired
  std::mutex err_mu_;
  std::string error_;
};

// A job of n work items (n = 0: complete at once), handed out in index order.
// An item may wait (spin_until) only for items of lower index: they were handed
// out earlier to running threads, so the wait always ends.
class ItemJob : public PoolJob {
 public:
  bool run(int worker) final;

 protected:
  void set_items(int64_t n) { n_items_ = n; }
  virtual void do_item(int64_t i, int worker) = 0;

 private:
  int64_t n_items_ = 0;
  std::atomic<bool> empty_claimed_{false};
  std::atomic<int64_t> next_{0};
  std::atomic<int64_t> completed_{0};
};

class ExpertPool {
 public:
  // The process's pool (started lazily by submit/threads/info).
  static ExpertPool& get();

  // Enqueues the jobs (run in this order, after every job submitted before)
  // and returns a handle for wait(). Never blocks on running jobs.
  int64_t submit(std::vector<std::shared_ptr<PoolJob>> jobs);
  // Blocks until every job of the handle is complete, forgets the handle and
  // returns its jobs (the caller then calls error() and release() on them,
  // see wait_and_release). Unknown handle: std::runtime_error.
  std::vector<std::shared_ptr<PoolJob>> wait(int64_t handle);

  // Restarts the pool with n threads (0: one per physical core) once the
  // queue is empty; returns the count now in use.
  int set_threads(int n);
  // Worker threads, and the threads that run a job someone waits on (workers + the waiter):
  // what work is divided by.
  int threads();
  int parallelism();
  std::string info();

  ExpertPool();
  ExpertPool(const ExpertPool&) = delete;
  ExpertPool& operator=(const ExpertPool&) = delete;

 private:
  struct State;
  std::unique_ptr<State> s_;
  void ensure_started_locked();
  void start_workers_locked(int n);
  void stop_workers_locked();
  void worker_main(int idx, uint64_t seen);
  void finish(PoolJob* job);
};

// Releases the GIL while the calling thread blocks (pool threads never need
// it), so other Python threads run; a no-op when called without the GIL.
struct GilRelease {
  GilRelease();
  ~GilRelease();
  GilRelease(const GilRelease&) = delete;
  GilRelease& operator=(const GilRelease&) = delete;

 private:
  void* st_ = nullptr;  // PyThreadState*
};

// Runs fn(i) for every i in [0, n) on the pool, the calling thread included, and returns
// once all are done (n == 1 runs inline). Items run in any order and on any thread, so fn
// must not depend on either, and runs without the GIL (released while waiting): it must not
// touch Python. The first exception is rethrown as c10::Error.
void parallel_items(int64_t n, const std::function<void(int64_t)>& fn);

// Waits for a handle with the GIL released, then, holding it again, drops the
// jobs' tensor references (PoolJob::release) and rethrows the first error
// (c10::Error). What every operator on the pool calls after submit().
void wait_and_release(ExpertPool& pool, int64_t handle);

// Spins (then yields) until a >= target; the acquire load orders the reads
// that follow after the writes released by the increments of a.
inline void spin_until(const std::atomic<int32_t>& a, int32_t target) {
  int spins = 0;
  while (a.load(std::memory_order_acquire) < target) {
    if (++spins < 4096) {
#if defined(__x86_64__) || defined(__i386__)
      __builtin_ia32_pause();
#endif
    } else {
      std::this_thread::yield();
    }
  }
}

}  // namespace sglk
