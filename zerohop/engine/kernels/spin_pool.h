// The kernels' own worker threads: they spin (yielding the core to anything else runnable)
// for a short while after each task, then sleep.
//
// Why not torch's OpenMP pool: its workers either spin without yielding (OMP_WAIT_POLICY=
// ACTIVE: the API process and the clients then starve at 32 streams, 40 vs 93 tok/s served) or
// sleep after every parallel region (PASSIVE: every one of a decode step's ~200 products
// pays a wake-up, 29 vs 20 ms per token at one stream). Spinning with sched_yield for a
// couple of milliseconds keeps both cores on a step's back-to-back products while giving the
// API process the core whenever it has work.
#pragma once

#include <sched.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace zerohop {

class SpinPool {
 public:
  using Task = std::function<void(int64_t begin, int64_t end)>;

  static SpinPool& instance() {
    static SpinPool pool;
    return pool;
  }

  int threads() const { return static_cast<int>(workers_.size()) + 1; }

  void resize(int threads) {
    std::lock_guard<std::mutex> run_lock(run_mutex_);
    stop_workers();
    // Each worker starts from the generation of now: read inside the thread, a task posted
    // before the thread first ran would count as already seen and never be done.
    const uint64_t seen = generation_.load(std::memory_order_acquire);
    for (int i = 1; i < threads; ++i) workers_.emplace_back([this, i, seen] { work(i, seen); });
  }

  // fn(begin, end) over [0, n) in threads() contiguous shares; the caller takes share 0.
  void run(int64_t n, const Task& fn) {
    std::lock_guard<std::mutex> run_lock(run_mutex_);
    const int shares = threads();
    if (shares == 1 || n < 2 * shares) {
      fn(0, n);
      return;
    }
    task_ = &fn;
    size_ = n;
    pending_.store(shares - 1, std::memory_order_relaxed);
    {
      std::lock_guard<std::mutex> lock(sleep_mutex_);
      generation_.fetch_add(1, std::memory_order_release);
    }
    if (sleepers_.load(std::memory_order_acquire) > 0) wake_.notify_all();
    run_share(0);
    // The workers are normally a few microseconds behind; if one lost its core, let the
    // scheduler run it here instead of spinning through our time slice.
    for (int spins = 0; pending_.load(std::memory_order_acquire) > 0; ++spins) {
      if (spins < 2048) {
        spin_pause();
      } else {
        sched_yield();
      }
    }
  }

  ~SpinPool() { stop_workers(); }

 private:
  static constexpr auto kSpinWindow = std::chrono::milliseconds(2);

  static void spin_pause() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }

  void run_share(int share) {
    const int shares = threads();
    const int64_t begin = size_ * share / shares, end = size_ * (share + 1) / shares;
    if (begin < end) (*task_)(begin, end);
  }

  void work(int share, uint64_t seen) {
    while (true) {
      wait_for_task(seen);
      if (stopping_.load(std::memory_order_acquire)) return;
      seen = generation_.load(std::memory_order_acquire);
      run_share(share);
      pending_.fetch_sub(1, std::memory_order_acq_rel);
    }
  }

  void wait_for_task(uint64_t seen) {
    const auto deadline = std::chrono::steady_clock::now() + kSpinWindow;
    while (generation_.load(std::memory_order_acquire) == seen) {
      if (stopping_.load(std::memory_order_acquire)) return;
      if (std::chrono::steady_clock::now() < deadline) {
        sched_yield();
        continue;
      }
      std::unique_lock<std::mutex> lock(sleep_mutex_);
      sleepers_.fetch_add(1, std::memory_order_acq_rel);
      wake_.wait(lock, [&] {
        return generation_.load(std::memory_order_acquire) != seen ||
               stopping_.load(std::memory_order_acquire);
      });
      sleepers_.fetch_sub(1, std::memory_order_acq_rel);
    }
  }

  void stop_workers() {
    {
      std::lock_guard<std::mutex> lock(sleep_mutex_);
      stopping_.store(true, std::memory_order_release);
    }
    wake_.notify_all();
    for (auto& t : workers_) t.join();
    workers_.clear();
    stopping_.store(false, std::memory_order_release);
  }

  std::vector<std::thread> workers_;
  std::mutex run_mutex_, sleep_mutex_;
  std::condition_variable wake_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_{0}, sleepers_{0};
  std::atomic<bool> stopping_{false};
  const Task* task_ = nullptr;
  int64_t size_ = 0;
};

}  // namespace zerohop
