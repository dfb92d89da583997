// The compute part of benchmarks/kernel_limits.py: 12 independent chains of one instruction
// on N std::threads at once, built by torch's load_inline (-O3 -march=native).
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#if defined(__AVX512F__)
#define ZH_FMA_ZMM 1
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define ZH_FMA_YMM 1
#endif
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
#define ZH_DOT_ZMM 1
#endif
#if defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define ZH_DOT_YMM 1
#define ZH_DPWSSD_YMM _mm256_dpwssd_epi32
#define ZH_DPBUSD_YMM _mm256_dpbusd_epi32
#elif defined(__AVXVNNI__)
#define ZH_DOT_YMM 1
#define ZH_DPWSSD_YMM _mm256_dpwssd_avx_epi32
#define ZH_DPBUSD_YMM _mm256_dpbusd_avx_epi32
#endif

namespace {

using Clock = std::chrono::steady_clock;

// body() on `threads` threads released together; seconds from the first start to the last end.
template <typename Body>
double on_threads(int64_t threads, Body body) {
  std::atomic<bool> go{false};
  std::vector<Clock::time_point> starts(threads), ends(threads);
  std::vector<std::thread> pool;
  for (int64_t t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      while (!go.load(std::memory_order_acquire)) std::this_thread::yield();
      starts[t] = Clock::now();
      body();
      ends[t] = Clock::now();
    });
  }
  go.store(true, std::memory_order_release);
  for (auto& thread : pool) thread.join();
  const auto first = *std::min_element(starts.begin(), starts.end());
  const auto last = *std::max_element(ends.begin(), ends.end());
  return std::chrono::duration<double>(last - first).count();
}

#define ZH_CHAINS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)

// `iterations` rounds of 12 independent chains acc = step(acc, a, b). The empty asm makes the
// operands opaque each round (no algebra across rounds) and every lane of every chain live at
// the end, so the compiler can drop none of the instructions.
template <typename Vec, typename Start, typename Step>
void chains(int64_t iterations, Start start, Vec a, Vec b, Step step) {
#define ZH_INIT(i) Vec acc##i = start(i);
#define ZH_STEP(i) acc##i = step(acc##i, a, b);
#define ZH_KEEP(i) asm volatile("" : : "v"(acc##i));
  ZH_CHAINS(ZH_INIT)
  for (int64_t n = 0; n < iterations; ++n) {
    asm volatile("" : "+v"(a), "+v"(b));
    ZH_CHAINS(ZH_STEP)
  }
  ZH_CHAINS(ZH_KEEP)
#undef ZH_INIT
#undef ZH_STEP
#undef ZH_KEEP
}

}  // namespace

// Each returns the seconds `threads` threads took for `iterations` rounds, or -1 where the
// instruction was not compiled in (see compiled()).
double fma_zmm(int64_t iterations, int64_t threads) {
#ifdef ZH_FMA_ZMM
  return on_threads(threads, [=] {
    chains(iterations, [](int i) { return _mm512_set1_ps(1.0f + i); }, _mm512_set1_ps(0.5f),
           _mm512_set1_ps(0.5f), [](__m512 c, __m512 a, __m512 b) {
             return _mm512_fmadd_ps(c, a, b);
           });
  });
#else
  return -1.0;
#endif
}

double fma_ymm(int64_t iterations, int64_t threads) {
#ifdef ZH_FMA_YMM
  return on_threads(threads, [=] {
    chains(iterations, [](int i) { return _mm256_set1_ps(1.0f + i); }, _mm256_set1_ps(0.5f),
           _mm256_set1_ps(0.5f), [](__m256 c, __m256 a, __m256 b) {
             return _mm256_fmadd_ps(c, a, b);
           });
  });
#else
  return -1.0;
#endif
}

double dpwssd_zmm(int64_t iterations, int64_t threads) {
#ifdef ZH_DOT_ZMM
  return on_threads(threads, [=] {
    chains(iterations, [](int i) { return _mm512_set1_epi32(i); }, _mm512_set1_epi16(3),
           _mm512_set1_epi16(5), [](__m512i c, __m512i a, __m512i b) {
             return _mm512_dpwssd_epi32(c, a, b);
           });
  });
#else
  return -1.0;
#endif
}

double dpwssd_ymm(int64_t iterations, int64_t threads) {
#ifdef ZH_DOT_YMM
  return on_threads(threads, [=] {
    chains(iterations, [](int i) { return _mm256_set1_epi32(i); }, _mm256_set1_epi16(3),
           _mm256_set1_epi16(5), [](__m256i c, __m256i a, __m256i b) {
             return ZH_DPWSSD_YMM(c, a, b);
           });
  });
#else
  return -1.0;
#endif
}

double dpbusd_zmm(int64_t iterations, int64_t threads) {
#ifdef ZH_DOT_ZMM
  return on_threads(threads, [=] {
    chains(iterations, [](int i) { return _mm512_set1_epi32(i); }, _mm512_set1_epi8(3),
           _mm512_set1_epi8(5), [](__m512i c, __m512i a, __m512i b) {
             return _mm512_dpbusd_epi32(c, a, b);
           });
  });
#else
  return -1.0;
#endif
}

double dpbusd_ymm(int64_t iterations, int64_t threads) {
#ifdef ZH_DOT_YMM
  return on_threads(threads, [=] {
    chains(iterations, [](int i) { return _mm256_set1_epi32(i); }, _mm256_set1_epi8(3),
           _mm256_set1_epi8(5), [](__m256i c, __m256i a, __m256i b) {
             return ZH_DPBUSD_YMM(c, a, b);
           });
  });
#else
  return -1.0;
#endif
}

// Seconds `threads` threads take to read their shares of `buffer` once, in vector loads (four
// streams a thread, kept live): the streaming-read limit a one-row product's weights meet.
double stream_read(torch::Tensor buffer, int64_t threads) {
  const float* data = buffer.data_ptr<float>();
  const int64_t share = buffer.numel() / threads / 64 * 64;
  std::atomic<int64_t> next{0};
  return on_threads(threads, [&] {
    const float* p = data + next.fetch_add(1) * share;
#ifdef __AVX512F__
    // Four streams a thread, a quarter of its share each: more misses in flight than one.
    const int64_t quarter = share / 4 / 16 * 16;
    __m512 a = _mm512_setzero_ps(), b = a, c = a, d = a;
    for (int64_t i = 0; i < quarter; i += 16) {
      a = _mm512_add_ps(a, _mm512_loadu_ps(p + i));
      b = _mm512_add_ps(b, _mm512_loadu_ps(p + quarter + i));
      c = _mm512_add_ps(c, _mm512_loadu_ps(p + 2 * quarter + i));
      d = _mm512_add_ps(d, _mm512_loadu_ps(p + 3 * quarter + i));
    }
    asm volatile("" : : "v"(a), "v"(b), "v"(c), "v"(d));
#else
    float total = 0.0f;
    for (int64_t i = 0; i < share; ++i) total += p[i];
    asm volatile("" : : "r"(total));
#endif
  });
}

// The functions above that run here, comma-separated.
std::string compiled() {
  std::string names;
#ifdef ZH_FMA_ZMM
  names += "fma_zmm,";
#endif
#ifdef ZH_FMA_YMM
  names += "fma_ymm,";
#endif
#ifdef ZH_DOT_ZMM
  names += "dpwssd_zmm,dpbusd_zmm,";
#endif
#ifdef ZH_DOT_YMM
  names += "dpwssd_ymm,dpbusd_ymm,";
#endif
  return names;
}
