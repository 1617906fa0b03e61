// The pool of pool.h. Protocol (every field of the region under ``m`` unless atomic):
//   caller: take ``busy`` (else run inline); under m: if a helper is still inside the
//     previous region, give up (inline); start missing helpers; publish the region
//     (n, call, ctx, next = done = 0, seats, open) and bump ``gen``; wake the helpers;
//     claim items until the counter passes n; close the region (open = false); wait
//     until done == n (a short bounded spin, then a condition variable); release busy.
//   helper: sleep until an open region it has not seen has a free seat; take the seat
//     (tid) and ``inside``; claim items until the counter passes n (counting done, and
//     waking the caller after the last one if it sleeps); leave (inside - 1); when the
//     region began soon after the previous one, spin a while (kHelperSpinSeconds) for
//     the next region; sleep.
// A helper that wakes after the items are gone takes nothing (its first claim passes
// n). The next region waits for no one: it runs inline while ``inside`` > 0, since
// such a helper may still touch the counters.
#include "pool.h"

#if defined(__unix__) || defined(__APPLE__)
#define RFMEM_POSIX 1
#include <fcntl.h>
#include <pthread.h>
#include <unistd.h>
#else
#define RFMEM_POSIX 0
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <limits>
#include <condition_variable>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define RFMEM_PAUSE() _mm_pause()
#else
#define RFMEM_PAUSE() ((void)0)
#endif

namespace rfmem {
namespace {

constexpr double kSpinSeconds = 20e-6;  // the caller's spin for a helper's item, before it sleeps
// (a helper's spin after a back-to-back region: pool.h kHelperSpinSeconds)

int64_t steady_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

struct Pool {
  std::mutex m;
  std::condition_variable work_cv;  // helpers sleep here
  std::condition_variable done_cv;  // a caller sleeps here (rarely)
  int helpers = 0;
  // the region
  uint64_t gen = 0;
  std::atomic<uint64_t> pub_gen{0};  // gen, readable without m (a helper's spin)
  bool spin = false;                  // the region's helpers spin after it (publish)
  std::atomic<int64_t> last_end{-1};  // steady_ns() when the last region ended, -1 before
  bool open = false;
  int64_t n = 0;
  void (*call)(const void*, int64_t, int) = nullptr;
  const void* ctx = nullptr;
  int seats = 0, max_seats = 0, inside = 0;
  bool caller_sleeps = false;
  // helpers not asleep on work_cv (running an item, or on their way to sleep): the
  // machine's running tasks count them, and their cores are this process's to use
  std::atomic<int> awake{0};
  std::atomic<int64_t> next{0}, done{0};
  std::atomic<bool> busy{false};
  // counters
  std::atomic<int64_t> regions{0}, inline_taken{0}, items_caller{0}, items_helper{0}, waits{0}, inline_busy{0};
  std::atomic<int64_t> idle_samples{0};  // samples of the machine's idle CPUs (idle_cpus)
  std::atomic<int64_t> spin_regions{0};  // regions after which the helpers spin (publish)
};

std::atomic<Pool*> g_pool{nullptr};
std::atomic<int> g_mode{static_cast<int>(PoolMode::kAuto)};

// the machine's idle CPUs, sampled at most every kIdleSampleSeconds
std::atomic<int64_t> g_idle_at{-1};  // steady_clock ns of the sample (>= 0), -1 before the first
std::atomic<int> g_idle{0};

int online_cpus() {
#if RFMEM_POSIX
  const long n = sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? static_cast<int>(n) : 1;
#else
  const unsigned n = std::thread::hardware_concurrency();
  return n ? static_cast<int>(n) : 1;
#endif
}

// tasks running or runnable now, the caller included (-1 if unknown: no /proc/loadavg)
int running_tasks() {
#if !defined(__linux__)
  return -1;
#else
  const int fd = open("/proc/loadavg", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return -1;
  char buf[128];
  const ssize_t got = read(fd, buf, sizeof buf - 1);
  close(fd);
  if (got <= 0) return -1;
  buf[got] = 0;
  return loadavg_running(buf);
#endif
}
#if RFMEM_POSIX
std::once_flag g_atfork_once;

// fork(): the child has none of the helpers (and maybe a locked mutex): a fresh pool;
// the parent's stays allocated (never freed: helpers may sleep in it until exit).
void atfork_child() { g_pool.store(new Pool, std::memory_order_release); }
#endif

Pool* pool() {
#if RFMEM_POSIX
  std::call_once(g_atfork_once, [] { pthread_atfork(nullptr, nullptr, &atfork_child); });
#endif
  Pool* p = g_pool.load(std::memory_order_acquire);
  if (p == nullptr) {
    Pool* fresh = new Pool;
    if (g_pool.compare_exchange_strong(p, fresh, std::memory_order_acq_rel))
      p = fresh;
    else
      delete fresh;
  }
  return p;
}

// Whether the last region ended (or PoolCall marked a call's end) within
// kHelperSpinSeconds: a region published now is back to back (its helpers spin after it).
bool back_to_back(const Pool* p) {
  const int64_t end = p->last_end.load(std::memory_order_relaxed);
  return end >= 0 && steady_ns() - end < static_cast<int64_t>(kHelperSpinSeconds * 1e9);
}

// Spins (pause; the clock read every 64 turns) while ``waiting()`` holds, at most
// ``seconds``, and (every 64 turns) until ``stop()``: the caller's wait for a helper's
// item, a helper's wait for the next region.
template <class F, class S>
void spin_while(const F& waiting, double seconds, const S& stop) {
  const int64_t t0 = steady_ns(), limit = static_cast<int64_t>(seconds * 1e9);
  for (int spin = 1; waiting(); ++spin) {
    RFMEM_PAUSE();
    if (spin % 64 == 0 && (steady_ns() - t0 > limit || stop())) break;
  }
}

template <class F>
void spin_while(const F& waiting, double seconds) {
  spin_while(waiting, seconds, [] { return false; });
}

void helper_main(Pool* p, uint64_t seen) {
#if defined(__linux__)
  pthread_setname_np(pthread_self(), "rfmem-pool");  // what /proc/<pid>/task/*/comm shows
#endif
  std::unique_lock<std::mutex> l(p->m);
  for (;;) {
    p->awake.fetch_sub(1, std::memory_order_relaxed);
    p->work_cv.wait(l, [&] { return p->open && p->gen != seen && p->seats < p->max_seats; });
    p->awake.fetch_add(1, std::memory_order_relaxed);
    seen = p->gen;
    const bool spin = p->spin;
    const int tid = 1 + p->seats++;
    ++p->inside;
    const int64_t n = p->n;
    void (*call)(const void*, int64_t, int) = p->call;
    const void* ctx = p->ctx;
    l.unlock();
    int64_t mine = 0;
    bool last = false;
    for (int64_t i = p->next.fetch_add(1, std::memory_order_relaxed); i < n;
         i = p->next.fetch_add(1, std::memory_order_relaxed)) {
      call(ctx, i, tid);
      ++mine;
      last = p->done.fetch_add(1, std::memory_order_acq_rel) + 1 == n;
    }
    p->items_helper.fetch_add(mine, std::memory_order_relaxed);
    l.lock();
    --p->inside;
    if (last && p->caller_sleeps) p->done_cv.notify_one();
    if (spin) {
      // (kAuto: no longer than the machine has an idle core for it. A helper spinning
      // beside another job's process takes CPU time from the caller: with a CPU-bound
      // process on the other core, a 400 us spin made one query 10-28 % slower than the
      // 200 us one; idle_cpus() counts this helper's own core as not taken)
      // The window runs from the later of this helper's leaving and the last end a caller
      // marked (pool_keep_awake: single-threaded work between back-to-back regions).
      l.unlock();
      const int64_t t0 = steady_ns(), lim = static_cast<int64_t>(kHelperSpinSeconds * 1e9);
      spin_while([&] { return p->pub_gen.load(std::memory_order_acquire) == seen; },
                 3600.0 /* (no limit of its own: the moving window below ends the spin) */, [&] {
                   if (steady_ns() - std::max(t0, p->last_end.load(std::memory_order_relaxed)) > lim) return true;
                   return g_mode.load(std::memory_order_relaxed) == static_cast<int>(PoolMode::kAuto) &&
                          idle_cpus() < 1;
                 });  // fmt: skip
      l.lock();
    }
  }
}

// Under p->m, with no helper inside: start missing helpers, publish the region.
void publish(Pool* p, int64_t n, int want, void (*call)(const void*, int64_t, int), const void* ctx) {
  while (p->helpers < want) {
    try {
      p->awake.fetch_add(1, std::memory_order_relaxed);  // until it first sleeps
      std::thread(helper_main, p, p->gen).detach();  // joins the region published below
      ++p->helpers;
    } catch (const std::system_error&) {
      p->awake.fetch_sub(1, std::memory_order_relaxed);
      break;  // the OS refuses threads: the caller and the helpers there do the work
    }
  }
  p->n = n;
  p->call = call;
  p->ctx = ctx;
  p->next.store(0, std::memory_order_relaxed);
  p->done.store(0, std::memory_order_relaxed);
  p->seats = 0;
  p->max_seats = want;
  p->spin = back_to_back(p);
  if (p->spin) p->spin_regions.fetch_add(1, std::memory_order_relaxed);
  p->open = true;
  ++p->gen;
  p->pub_gen.store(p->gen, std::memory_order_release);
}

// The behaviour before the pool: threads started for the region, joined at its end.
void run_spawned(int64_t n, int nthreads, void (*call)(const void*, int64_t, int), const void* ctx) {
  std::atomic<int64_t> next{0};
  auto work = [&](int tid) {
    for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < n;
         i = next.fetch_add(1, std::memory_order_relaxed))
      call(ctx, i, tid);
  };
  std::vector<std::thread> threads;
  threads.reserve(static_cast<size_t>(nthreads - 1));
  for (int t = 1; t < nthreads; ++t) {
    try {
      threads.emplace_back(work, t);
    } catch (const std::system_error&) {
      break;
    }
  }
  work(0);
  for (std::thread& th : threads) th.join();
}

void run_inline(int64_t n, void (*call)(const void*, int64_t, int), const void* ctx) {
  for (int64_t i = 0; i < n; ++i) call(ctx, i, 0);
}

}  // namespace

int loadavg_running(const char* text) {
  const char* c = text;  // "0.52 0.58 0.59 2/99 1234": skip three fields
  for (int f = 0; f < 3; ++f) {
    while (*c && *c != ' ') ++c;
    while (*c == ' ') ++c;
  }
  if (*c < '0' || *c > '9') return -1;
  int r = 0;
  while (*c >= '0' && *c <= '9' && r < (1 << 24)) r = r * 10 + (*c++ - '0');
  return *c == '/' ? r : -1;
}

int idle_count(int cpus, int running, int own) {
  if (running < 0) return cpus;
  return std::min(cpus, std::max(0, cpus - running + std::max(0, own)));
}

int idle_cpus() {
  const int64_t now = steady_ns();
  const int64_t at = g_idle_at.load(std::memory_order_acquire);
  // (the first call samples: ``now - at`` with ``at`` the int64 minimum overflowed, so the
  // check returned the initial 0 idle CPUs forever and every region of kAuto ran inline)
  if (at >= 0 && now - at < static_cast<int64_t>(kIdleSampleSeconds * 1e9))
    return g_idle.load(std::memory_order_relaxed);
  // the pool's own awake helpers are among the running tasks: their cores are not taken
  // by another job (counting them made every other region of a busy process run inline)
  Pool* p = pool();
  const int own = p->awake.load(std::memory_order_relaxed);
  const int cpus = online_cpus(), running = running_tasks();
  const int idle = idle_count(cpus, running, own);
  p->idle_samples.fetch_add(1, std::memory_order_relaxed);
  g_idle.store(idle, std::memory_order_relaxed);
  g_idle_at.store(now, std::memory_order_release);
  return idle;
}

void pool_run(int64_t n, int nthreads, void (*call)(const void* ctx, int64_t i, int tid), const void* ctx) {
  const PoolMode mode = static_cast<PoolMode>(g_mode.load(std::memory_order_relaxed));
  if (mode == PoolMode::kPerCall) {
    run_spawned(n, nthreads, call, ctx);
    return;
  }
  Pool* p = pool();
  int want = std::min(nthreads - 1, kMaxHelpers);
  if (mode == PoolMode::kAuto) {
    want = std::min(want, idle_cpus());
    if (want < 1) {  // every core is taken: the caller alone
      p->inline_busy.fetch_add(1, std::memory_order_relaxed);
      run_inline(n, call, ctx);
      return;
    }
  }
  bool expected = false;
  if (!p->busy.compare_exchange_strong(expected, true, std::memory_order_acquire)) {
    p->inline_taken.fetch_add(1, std::memory_order_relaxed);
    run_inline(n, call, ctx);
    return;
  }
  bool lagging = false;
  {
    std::lock_guard<std::mutex> g(p->m);
    lagging = p->inside > 0;  // a helper of the previous region has not left it yet
    if (!lagging) publish(p, n, want, call, ctx);
  }
  if (lagging) {
    p->busy.store(false, std::memory_order_release);
    p->inline_taken.fetch_add(1, std::memory_order_relaxed);
    run_inline(n, call, ctx);
    return;
  }
  if (want == 1)
    p->work_cv.notify_one();
  else
    p->work_cv.notify_all();
  p->regions.fetch_add(1, std::memory_order_relaxed);
  int64_t mine = 0;
  for (int64_t i = p->next.fetch_add(1, std::memory_order_relaxed); i < n;
       i = p->next.fetch_add(1, std::memory_order_relaxed)) {
    call(ctx, i, 0);
    ++mine;
    p->done.fetch_add(1, std::memory_order_acq_rel);
  }
  p->items_caller.fetch_add(mine, std::memory_order_relaxed);
  {
    std::lock_guard<std::mutex> g(p->m);
    p->open = false;  // a helper waking from now on sleeps again
  }
  // the items helpers are running: a short spin (kSpinSeconds: a running helper finishes
  // its item within a few us), then sleep
  spin_while([&] { return p->done.load(std::memory_order_acquire) < n; }, kSpinSeconds);
  if (p->done.load(std::memory_order_acquire) < n) {
    p->waits.fetch_add(1, std::memory_order_relaxed);
    std::unique_lock<std::mutex> l(p->m);
    p->caller_sleeps = true;
    p->done_cv.wait(l, [&] { return p->done.load(std::memory_order_acquire) >= n; });
    p->caller_sleeps = false;
  }
  p->last_end.store(steady_ns(), std::memory_order_relaxed);
  p->busy.store(false, std::memory_order_release);
}

PoolMode set_thread_pool(PoolMode mode) { return static_cast<PoolMode>(g_mode.exchange(static_cast<int>(mode))); }

PoolCall::PoolCall(int nthreads, double work) : threads_(nthreads) {
  if (nthreads <= 1 || static_cast<PoolMode>(g_mode.load(std::memory_order_relaxed)) != PoolMode::kAuto) return;
  Pool* p = g_pool.load(std::memory_order_acquire);
  if (work < kAloneAfterGapWork && pool_awake_helpers() == 0 && (p == nullptr || !back_to_back(p))) {
    threads_ = 1;
    mark_end_ = true;
  } else if (idle_cpus() < 1) {  // (after the gap's test: the first sample after a gap reads /proc/loadavg)
    threads_ = 1;
  }
}

PoolCall::~PoolCall() {
  if (mark_end_) pool()->last_end.store(steady_ns(), std::memory_order_relaxed);
}

void pool_keep_awake() {
  Pool* p = g_pool.load(std::memory_order_acquire);
  if (p != nullptr && p->awake.load(std::memory_order_relaxed) > 0)
    p->last_end.store(steady_ns(), std::memory_order_relaxed);
}

int pool_awake_helpers() {
  Pool* p = g_pool.load(std::memory_order_acquire);
  return p == nullptr ? 0 : std::max(0, p->awake.load(std::memory_order_relaxed));
}

PoolCounters pool_counters() {
  Pool* p = pool();
  PoolCounters c;
  c.regions = p->regions.load();
  c.inline_taken = p->inline_taken.load();
  c.items_caller = p->items_caller.load();
  c.items_helper = p->items_helper.load();
  c.waits = p->waits.load();
  c.inline_busy = p->inline_busy.load();
  c.idle_samples = p->idle_samples.load();
  c.spin_regions = p->spin_regions.load();
  {
    std::lock_guard<std::mutex> g(p->m);
    c.helpers = p->helpers;
  }
  return c;
}

}  // namespace rfmem
