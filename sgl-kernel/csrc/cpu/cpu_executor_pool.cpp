// Persistent pinned worker pool of the CPU executor (see cpu_executor_pool.h).
#include "cpu_executor_pool.h"

#include <Python.h>
#include <sched.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <fstream>
#include <functional>
#include <mutex>
#include <set>
#include <sstream>
#include <stdexcept>
#include <unordered_map>
#include <utility>

#include "common.h"

namespace sglk {
namespace {

using Clock = std::chrono::steady_clock;

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

bool read_int(const std::string& path, long* v) {
  std::ifstream f(path);
  return static_cast<bool>(f >> *v);
}

// One CPU per physical core among the CPUs this process may run on.
struct Topology {
  std::vector<int> cores;  // first allowed CPU of each physical core
  int allowed = 0;         // CPUs in the affinity set
  std::string source;
};

Topology detect_topology() {
  Topology t;
  std::vector<int> cpus;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(getpid(), sizeof(set), &set) == 0) {
    for (int c = 0; c < CPU_SETSIZE; ++c)
      if (CPU_ISSET(c, &set)) cpus.push_back(c);
  }
  if (cpus.empty()) {
    const int n = std::max(1u, std::thread::hardware_concurrency());
    for (int c = 0; c < n; ++c) cpus.push_back(c);
    t.source = "hardware_concurrency (sched_getaffinity failed)";
  }
  t.allowed = static_cast<int>(cpus.size());
  std::set<std::pair<long, long>> seen;
  bool sysfs = true;
  for (int c : cpus) {
    long pkg = 0, core = 0;
    const std::string base = "/sys/devices/system/cpu/cpu" + std::to_string(c) + "/topology/";
    if (!read_int(base + "physical_package_id", &pkg) || !read_int(base + "core_id", &core)) {
      sysfs = false;
      break;
    }
    if (seen.insert({pkg, core}).second) t.cores.push_back(c);
  }
  if (!sysfs) {
    t.cores = cpus;
    if (t.source.empty()) t.source = "sched_getaffinity, one core per CPU (no sysfs topology)";
  } else if (t.source.empty()) {
    t.source = "sysfs topology within sched_getaffinity";
  }
  return t;
}

// SGLANG_CPU_EXPERT_PIN=0 leaves the threads unpinned (e.g. on a machine
// shared with other jobs, where the scheduler may move them to an idle core).
bool pin_enabled() {
  const char* e = std::getenv("SGLANG_CPU_EXPERT_PIN");
  return !(e && std::string(e) == "0");
}

// How long an idle worker (and a waiter with nothing left to take) spins before it sleeps.
// Long enough to bridge the gaps between the ops of a decode step (a sleeping worker takes
// tens of us to wake, each op); a worker spins on its own core, since by default the pool
// leaves one core to the waiting thread. Chosen by measurement: benchmark/RESULTS.md,
// cpu_decode ("The waiting thread works").
constexpr long kDefaultSpinUs = 300;

int64_t spin_ns() {
  static const int64_t ns = [] {
    const char* e = std::getenv("SGLANG_CPU_EXPERT_SPIN_US");
    const long us = e && *e ? std::strtol(e, nullptr, 10) : kDefaultSpinUs;
    return static_cast<int64_t>(std::max(0L, us)) * 1000;
  }();
  return ns;
}

// Spins up to spin_ns() while pred() is false; returns pred().
template <typename P>
bool spin_for(P pred) {
  if (pred()) return true;
  const int64_t limit = spin_ns();
  if (limit <= 0) return false;
  const auto t0 = Clock::now();
  for (;;) {
    for (int i = 0; i < 64; ++i) {
      cpu_relax();
      if (pred()) return true;
    }
    if (std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count() > limit) return pred();
  }
}

// Workers by default: one per physical core but one, whose share the thread waiting on a job
// takes (ExpertPool::wait works on the running job); one at least.
int default_workers(const Topology& t) { return std::max(1, static_cast<int>(t.cores.size()) - 1); }

// fn(i) for each item, as one job.
class FnJob final : public ItemJob {
 public:
  FnJob(int64_t n, const std::function<void(int64_t)>* fn) : fn_(fn) { set_items(n); }

 protected:
  void do_item(int64_t i, int) override { (*fn_)(i); }

 private:
  const std::function<void(int64_t)>* fn_;
};

}  // namespace

void PoolJob::set_error(const std::string& msg) {
  std::lock_guard<std::mutex> lk(err_mu_);
  if (error_.empty()) error_ = msg.empty() ? "unknown error in a CPU expert pool job" : msg;
}

std::string PoolJob::error() {
  std::lock_guard<std::mutex> lk(err_mu_);
  return error_;
}

bool ItemJob::run(int worker) {
  if (n_items_ == 0) return !empty_claimed_.exchange(true);  // complete at once
  bool completed = false;
  for (;;) {
    const int64_t i = next_.fetch_add(1, std::memory_order_relaxed);
    if (i >= n_items_) return completed;
    try {
      do_item(i, worker);
    } catch (const std::exception& e) {
      set_error(e.what());
    } catch (...) {
      set_error("");
    }
    if (completed_.fetch_add(1, std::memory_order_acq_rel) + 1 == n_items_) completed = true;
  }
}

struct ExpertPool::State {
  std::mutex cfg_mu;  // serialises start / restart against submit
  std::mutex mu;      // queue, handles, errors
  std::condition_variable work_cv;
  std::condition_variable done_cv;
  std::atomic<uint64_t> gen{0};  // bumped when a job starts or the workers stop
  std::atomic<bool> stop{false};
  std::shared_ptr<PoolJob> current;            // guarded by mu
  std::deque<std::shared_ptr<PoolJob>> queue;  // front: the running job
  std::unordered_map<int64_t, std::vector<std::shared_ptr<PoolJob>>> handles;
  int64_t next_handle = 1;

  std::vector<std::thread> workers;
  int nthreads = 0;
  bool started = false;
  Topology topo;
  std::vector<int> cpu_of;                         // worker -> CPU it is pinned to
  std::unique_ptr<std::atomic<int>[]> pin_result;  // worker -> 1 pinned, 0 failed, -1 not yet
  std::atomic<int> ready{0};
};

ExpertPool::ExpertPool() : s_(new State) {}

ExpertPool& ExpertPool::get() {
  // A forked child gets a fresh pool: the parent's threads do not exist there
  // and its mutexes may be in any state, so the old object is abandoned.
  static std::atomic<ExpertPool*> pool{nullptr};
  static std::atomic<pid_t> owner{0};
  static std::mutex mu;
  const pid_t pid = getpid();
  ExpertPool* p = pool.load(std::memory_order_acquire);
  if (p != nullptr && owner.load(std::memory_order_acquire) == pid) return *p;
  std::lock_guard<std::mutex> lk(mu);
  p = pool.load(std::memory_order_acquire);
  if (p == nullptr || owner.load(std::memory_order_acquire) != pid) {
    p = new ExpertPool();  // never deleted: threads may outlive static destruction
    owner.store(pid, std::memory_order_release);
    pool.store(p, std::memory_order_release);
  }
  return *p;
}

void ExpertPool::ensure_started_locked() {
  if (s_->started) return;
  s_->topo = detect_topology();
  start_workers_locked(default_workers(s_->topo));
  s_->started = true;
}

void ExpertPool::start_workers_locked(int n) {
  State& s = *s_;
  n = std::max(1, n);
  s.nthreads = n;
  s.stop.store(false, std::memory_order_release);
  s.cpu_of.assign(n, -1);
  s.pin_result.reset(new std::atomic<int>[n]);
  for (int i = 0; i < n; ++i) {
    // With fewer workers than cores the first core is left to the waiting thread (a caller
    // is not pinned; the OS puts it on the core no worker holds).
    const size_t nc = s.topo.cores.size(), skip = static_cast<size_t>(n) < nc ? 1 : 0;
    s.cpu_of[i] = nc == 0 ? -1 : s.topo.cores[(i + skip) % nc];
    s.pin_result[i].store(-1);
  }
  s.ready.store(0);
  const uint64_t g = s.gen.load(std::memory_order_acquire);
  for (int i = 0; i < n; ++i) s.workers.emplace_back([this, i, g] { worker_main(i, g); });
  while (s.ready.load(std::memory_order_acquire) < n) std::this_thread::yield();
}

void ExpertPool::stop_workers_locked() {
  State& s = *s_;
  {
    std::lock_guard<std::mutex> lk(s.mu);
    s.stop.store(true, std::memory_order_release);
    s.gen.fetch_add(1, std::memory_order_acq_rel);
  }
  s.work_cv.notify_all();
  for (auto& t : s.workers) t.join();
  s.workers.clear();
  s.nthreads = 0;
}

void ExpertPool::worker_main(int idx, uint64_t seen) {
  State& s = *s_;
  const int cpu = s.cpu_of[idx];
  int pinned = 0;
  if (cpu >= 0 && pin_enabled()) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    pinned = sched_setaffinity(0, sizeof(set), &set) == 0 ? 1 : 0;
  }
  s.pin_result[idx].store(pinned, std::memory_order_release);
  s.ready.fetch_add(1, std::memory_order_acq_rel);
  for (;;) {
    std::shared_ptr<PoolJob> job;
    {
      auto changed = [&] { return s.gen.load(std::memory_order_acquire) != seen; };
      const bool spun = spin_for(changed);
      std::unique_lock<std::mutex> lk(s.mu);
      if (!spun) s.work_cv.wait(lk, changed);
      seen = s.gen.load(std::memory_order_acquire);
      if (s.stop.load(std::memory_order_acquire)) return;
      job = s.current;
    }
    if (job && job->run(idx)) finish(job.get());
  }
}

// Called by the thread that completed the running job's last item: retire it
// and start the next one.
void ExpertPool::finish(PoolJob* job) {
  State& s = *s_;
  std::shared_ptr<PoolJob> keep;  // released after the lock
  {
    std::lock_guard<std::mutex> lk(s.mu);
    keep = std::move(s.queue.front());
    s.queue.pop_front();
    job->done_.store(1, std::memory_order_release);
    s.current = s.queue.empty() ? nullptr : s.queue.front();
    if (s.current) s.gen.fetch_add(1, std::memory_order_acq_rel);
  }
  s.work_cv.notify_all();
  s.done_cv.notify_all();
}

int64_t ExpertPool::submit(std::vector<std::shared_ptr<PoolJob>> jobs) {
  State& s = *s_;
  std::lock_guard<std::mutex> cfg(s.cfg_mu);
  ensure_started_locked();
  int64_t h;
  bool started_one = false;
  {
    std::lock_guard<std::mutex> lk(s.mu);
    h = s.next_handle++;
    const bool idle = s.queue.empty();
    for (auto& j : jobs) s.queue.push_back(j);
    s.handles.emplace(h, std::move(jobs));
    if (idle && !s.queue.empty()) {
      s.current = s.queue.front();
      s.gen.fetch_add(1, std::memory_order_acq_rel);
      started_one = true;
    }
  }
  if (started_one) s.work_cv.notify_all();
  return h;
}

std::vector<std::shared_ptr<PoolJob>> ExpertPool::wait(int64_t handle) {
  State& s = *s_;
  std::vector<std::shared_ptr<PoolJob>> jobs;
  {
    std::lock_guard<std::mutex> lk(s.mu);
    auto it = s.handles.find(handle);
    if (it == s.handles.end())
      throw std::runtime_error("moe_experts_cpu_wait: unknown handle " + std::to_string(handle) +
                               " (never returned by moe_experts_cpu_submit, or already waited)");
    jobs = std::move(it->second);
    s.handles.erase(it);
  }
  if (jobs.empty()) return jobs;
  // FIFO: the last job of the handle completes after all earlier ones
  PoolJob* last = jobs.back().get();
  auto is_done = [&] { return last->done_.load(std::memory_order_acquire) != 0; };
  // The waiting thread works on the running job (whichever handle it belongs to: every job
  // ahead of ours must finish first) until its items are all handed out, then waits for the
  // next job to start or ours to complete. So the caller's core streams with the workers
  // instead of spinning beside them, and a job of a few items starts without waiting for a
  // sleeping worker to wake (cpu_executor_pool.h).
  const int me = s.nthreads;  // a slot past the workers' (no job keeps per-worker storage)
  for (;;) {
    std::shared_ptr<PoolJob> job;
    uint64_t seen;
    {
      std::lock_guard<std::mutex> lk(s.mu);
      seen = s.gen.load(std::memory_order_acquire);
      job = s.current;
    }
    if (job && job->run(me)) {
      finish(job.get());
      continue;
    }
    auto next = [&] { return is_done() || s.gen.load(std::memory_order_acquire) != seen; };
    if (!spin_for(next)) {
      std::unique_lock<std::mutex> lk(s.mu);
      s.done_cv.wait(lk, next);
    }
    if (is_done()) return jobs;
  }
}

int ExpertPool::set_threads(int n) {
  State& s = *s_;
  if (n < 0)
    throw std::runtime_error("expert_pool_set_threads: n must be >= 0 (0 = one per physical core), got " +
                             std::to_string(n));
  std::lock_guard<std::mutex> cfg(s.cfg_mu);
  ensure_started_locked();
  const int want = n == 0 ? default_workers(s.topo) : n;
  if (want == s.nthreads) return s.nthreads;
  {
    std::unique_lock<std::mutex> lk(s.mu);
    s.done_cv.wait(lk, [&] { return s.queue.empty(); });
  }
  stop_workers_locked();
  start_workers_locked(want);
  return s.nthreads;
}

int ExpertPool::parallelism() { return threads() + 1; }

int ExpertPool::threads() {
  std::lock_guard<std::mutex> cfg(s_->cfg_mu);
  ensure_started_locked();
  return s_->nthreads;
}

std::string ExpertPool::info() {
  State& s = *s_;
  std::lock_guard<std::mutex> cfg(s.cfg_mu);
  ensure_started_locked();
  std::ostringstream o;
  int ok = 0;
  std::ostringstream cpus;
  for (int i = 0; i < s.nthreads; ++i) {
    const int r = s.pin_result[i].load(std::memory_order_acquire);
    ok += r == 1;
    if (r == 1)
      cpus << (i ? "," : "") << s.cpu_of[i];
    else
      cpus << (i ? "," : "") << "any";
  }
  const CpuExecutorKernels& mk = cpu_executor_kernels();
  o << "threads=" << s.nthreads << " pinned=" << ok << "/" << s.nthreads
    << (pin_enabled() ? "" : " (SGLANG_CPU_EXPERT_PIN=0)") << " cpus=" << cpus.str()
    << " physical_cores=" << s.topo.cores.size() << " allowed_cpus=" << s.topo.allowed << " topology=\""
    << s.topo.source << "\" isa=" << current_isa() << " dot=\"" << mk.dot << "\" spin_us=" << spin_ns() / 1000;
  return o.str();
}

GilRelease::GilRelease() {
  if (Py_IsInitialized() && PyGILState_Check()) st_ = PyEval_SaveThread();
}

GilRelease::~GilRelease() {
  if (st_) PyEval_RestoreThread(static_cast<PyThreadState*>(st_));
}

void parallel_items(int64_t n, const std::function<void(int64_t)>& fn) {
  if (n <= 0) return;
  if (n == 1) {
    fn(0);
    return;
  }
  ExpertPool& pool = ExpertPool::get();
  wait_and_release(pool, pool.submit({std::make_shared<FnJob>(n, &fn)}));
}

void wait_and_release(ExpertPool& pool, int64_t handle) {
  std::vector<std::shared_ptr<PoolJob>> jobs;
  {
    GilRelease nogil;
    jobs = pool.wait(handle);
  }
  std::string err;
  for (auto& j : jobs) {
    if (err.empty()) err = j->error();
    j->release();
  }
  TORCH_CHECK(err.empty(), err);
}

}  // namespace sglk
