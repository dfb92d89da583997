// The kernels' own worker threads: they spin for a short while after each task, then sleep.
//
// Why not torch's OpenMP pool: its workers either spin without yielding (OMP_WAIT_POLICY=
// ACTIVE: the API process and the clients then starve at 32 streams, 40 vs 93 tok/s served) or
// sleep after every parallel region (PASSIVE: every one of a decode step's ~200 products
// pays a wake-up, 29 vs 20 ms per token at one stream). Spinning for a couple of milliseconds
// keeps both cores on a step's back-to-back products; yielding in the later part of that
// window gives the API process the core whenever it has work.
//
// Work is handed out in chunks (several per thread) claimed from one atomic counter, not in
// one fixed share per thread: a thread that lost its core to another process (a noisy
// neighbour) then holds up at most the chunk it is in, and the threads still running do the
// rest. With fixed shares every product waited a whole time slice for the descheduled share
// (one busy process beside a 2-thread engine: 4x the time per token).
#pragma once

#include <sched.h>

#include <algorithm>
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
    const uint64_t seen = generation(ticket_.load(std::memory_order_acquire));
    for (int i = 1; i < threads; ++i) workers_.emplace_back([this, seen] { work(seen); });
  }

  // fn(begin, end) over [0, n), in chunks whose bounds are multiples of `align` (but n),
  // run by whichever threads are running; the caller takes part and returns when all are done.
  void run(int64_t n, const Task& fn, int64_t align = 1) {
    std::lock_guard<std::mutex> run_lock(run_mutex_);
    const int64_t chunks = std::min<int64_t>(threads() * kChunksPerThread, n / align);
    if (threads() == 1 || n < 2 * threads() || chunks < 2) {
      fn(0, n);
      return;
    }
    task_.store(&fn, std::memory_order_relaxed);
    size_.store(n, std::memory_order_relaxed);
    align_.store(align, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    const uint64_t gen = generation(ticket_.load(std::memory_order_relaxed)) + 1;
    {
      std::lock_guard<std::mutex> lock(sleep_mutex_);
      ticket_.store(pack(gen, chunks, 0), std::memory_order_release);
    }
    if (sleepers_.load(std::memory_order_acquire) > 0) wake_.notify_all();
    run_chunks(gen);
    wait_for_chunks(chunks);
  }

  ~SpinPool() { stop_workers(); }

 private:
  static constexpr int64_t kChunksPerThread = 8;
  // After a task a worker spins on the CPU (pause) this long: a step's products follow each
  // other within microseconds, and a sched_yield on a core shared with a busy process hands
  // it over for a whole time slice. Then it yields, then it sleeps.
  static constexpr auto kHotSpin = std::chrono::microseconds(200);
  static constexpr auto kSpinWindow = std::chrono::milliseconds(2);
  // A claimed chunk not done after this long is on a thread that lost its core: the caller
  // then sleeps, so that its idle core can take that thread over (the scheduler pulls
  // runnable threads to idle cores) instead of being spun on.
  static constexpr auto kCallerSpin = std::chrono::microseconds(50);

  // ticket_: the run's generation (32 bits), its chunk count and the next chunk to claim (16
  // bits each), in one word, so that a claim is checked against the run it was read from.
  static constexpr uint64_t pack(uint64_t gen, int64_t chunks, int64_t next) {
    return (gen << 32) | (static_cast<uint64_t>(chunks) << 16) | static_cast<uint64_t>(next);
  }
  static constexpr uint64_t generation(uint64_t ticket) { return ticket >> 32; }
  static constexpr int64_t chunk_count(uint64_t ticket) { return (ticket >> 16) & 0xFFFF; }
  static constexpr int64_t next_chunk(uint64_t ticket) { return ticket & 0xFFFF; }

  static void spin_pause() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }

  // The next unclaimed chunk of run `gen` into *index (and the run's chunk count into
  // *chunks), or false when there is none (or that run is over). The run's task and size,
  // read before the claim, are valid once it succeeds: the caller cannot start another run
  // while a chunk of this one is outstanding.
  bool claim(uint64_t gen, int64_t* index, int64_t* chunks) {
    uint64_t ticket = ticket_.load(std::memory_order_acquire);
    while (generation(ticket) == gen && next_chunk(ticket) < chunk_count(ticket)) {
      if (ticket_.compare_exchange_weak(ticket, ticket + 1, std::memory_order_acq_rel,
                                        std::memory_order_acquire)) {
        *index = next_chunk(ticket);
        *chunks = chunk_count(ticket);
        return true;
      }
    }
    return false;
  }

  // Chunks of run `gen` until none is left.
  void run_chunks(uint64_t gen) {
    const Task* task = task_.load(std::memory_order_relaxed);
    const int64_t n = size_.load(std::memory_order_relaxed);
    const int64_t align = align_.load(std::memory_order_relaxed);
    int64_t index = 0, count = 0, chunks = 0;
    while (claim(gen, &index, &chunks)) {
      (*task)(bound(index, chunks, n, align), bound(index + 1, chunks, n, align));
      ++count;
    }
    if (count == 0) return;
    const int64_t done = done_.fetch_add(count, std::memory_order_seq_cst) + count;
    if (done == chunks && caller_sleeps_.load(std::memory_order_seq_cst)) {
      std::lock_guard<std::mutex> lock(done_mutex_);
      done_wake_.notify_one();
    }
  }

  static int64_t bound(int64_t index, int64_t chunks, int64_t n, int64_t align) {
    if (index == chunks) return n;
    return std::min(n, (n / align) * index / chunks * align);
  }

  void wait_for_chunks(int64_t chunks) {
    const auto deadline = std::chrono::steady_clock::now() + kCallerSpin;
    for (int spins = 0; done_.load(std::memory_order_acquire) < chunks; ++spins) {
      spin_pause();
      if ((spins & 63) == 63 && std::chrono::steady_clock::now() > deadline) break;
    }
    if (done_.load(std::memory_order_acquire) == chunks) return;
    std::unique_lock<std::mutex> lock(done_mutex_);
    caller_sleeps_.store(true, std::memory_order_seq_cst);
    done_wake_.wait(lock, [&] { return done_.load(std::memory_order_seq_cst) == chunks; });
    caller_sleeps_.store(false, std::memory_order_relaxed);
  }

  void work(uint64_t seen) {
    while (true) {
      seen = wait_for_task(seen);
      if (stopping_.load(std::memory_order_acquire)) return;
      run_chunks(seen);
    }
  }

  // The generation of the next run (a newer one than `seen`).
  uint64_t wait_for_task(uint64_t seen) {
    const auto start = std::chrono::steady_clock::now();
    for (int spins = 0;; ++spins) {
      const uint64_t gen = generation(ticket_.load(std::memory_order_acquire));
      if (gen != seen || stopping_.load(std::memory_order_acquire)) return gen;
      if ((spins & 63) != 63) {
        spin_pause();
        continue;
      }
      const auto idle = std::chrono::steady_clock::now() - start;
      if (idle < kHotSpin) continue;
      if (idle < kSpinWindow) {
        sched_yield();
        continue;
      }
      std::unique_lock<std::mutex> lock(sleep_mutex_);
      sleepers_.fetch_add(1, std::memory_order_acq_rel);
      wake_.wait(lock, [&] {
        return generation(ticket_.load(std::memory_order_acquire)) != seen ||
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
  std::mutex run_mutex_, sleep_mutex_, done_mutex_;
  std::condition_variable wake_, done_wake_;
  std::atomic<uint64_t> ticket_{0};
  std::atomic<int64_t> done_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<bool> stopping_{false}, caller_sleeps_{false};
  std::atomic<const Task*> task_{nullptr};
  std::atomic<int64_t> size_{0}, align_{1};
};

}  // namespace zerohop
