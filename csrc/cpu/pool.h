// The threads of the CPU kernels (common.h parallel_for): a small process-wide pool of
// helper threads that SLEEP on a condition variable between calls (after a short spin,
// at most kHelperSpinSeconds = 400 us, after a region that began within that time of the
// previous one's end, so that back-to-back calls find them awake), and a caller that
// never waits for a helper to show up.
//
// A parallel region (pool_run) publishes its items and wakes up to nthreads - 1 helpers,
// then works through the items itself, claiming them one at a time from an atomic
// counter; a helper that gets a core joins and claims items the same way. The caller
// waits only for items a helper has already claimed and is running, so a helper that
// the OS does not schedule in time (a busy machine) costs the call one wake-up call
// (a futex wake, ~5-15 us) and nothing else: the caller simply does every item.
//
// One region runs on the pool at a time: a call that finds it taken (another thread of
// the process is in a parallel region, or a helper of the previous region has not left
// it yet) runs its items on the calling thread alone. So threads are only ever added
// to a call when the process is otherwise idle, and two concurrent calls (a server's
// workers) never oversubscribe the cores through the pool.
//
// Helpers are started on first use (up to the most threads any call asked for, at most
// kMaxHelpers), detached, and never stopped; after fork() the child starts a fresh pool.
// The machine: in the default mode a region adds helpers only for the cores that were
// idle at the last sample (at most every 2 ms) of the running tasks (/proc/loadavg), so
// a process sharing the machine with CPU-bound processes runs as on one thread; its
// helpers are never woken to compete with them (or, placed on the caller's core by the
// scheduler, with the caller itself). set_thread_pool(PoolMode::kPerCall) restores the
// previous behaviour (threads started for one call and joined before it returns).
#pragma once

#include <cstdint>

namespace rfmem {

/// Most helper threads the pool starts.
constexpr int kMaxHelpers = 255;

/// Calls call(ctx, i, tid) for every i in [0, n) on the calling thread (tid 0) and up to
/// nthreads - 1 helpers (tid 1 .. nthreads - 1, each tid used by one thread at a time);
/// returns when every call has returned. ``call`` must not throw. nthreads >= 2.
void pool_run(int64_t n, int nthreads, void (*call)(const void* ctx, int64_t i, int tid), const void* ctx);

/// How parallel regions get their threads (process-wide; set_thread_pool):
enum class PoolMode : int {
  kAuto = 0,     // the pool, with helpers only for the cores that were idle at the last
                 // sample of /proc/loadavg (at most every kIdleSampleSeconds): on a machine
                 // whose cores are all taken, a region runs on the caller alone (default)
  kAlways = 1,   // the pool, whatever the machine's load (tests, benchmarks)
  kPerCall = 2,  // threads started for each region and joined at its end (before the pool)
};

/// Sets the mode of later regions and returns the previous one. Results never depend on it.
PoolMode set_thread_pool(PoolMode mode);

/// Seconds between two samples of the machine's running tasks (kAuto).
constexpr double kIdleSampleSeconds = 2e-3;

/// A helper's spin after it leaves a region, before it sleeps, when the region began
/// within kHelperSpinSeconds of the previous one's end (a caller calling back to back:
/// one query after another, or the probe and the rounds of one search): the next region
/// finds it awake instead of paying a wake-up on the condition variable (tens of us in a
/// VM): a region that must wake its helper is slower than the caller alone (one query
/// over 4,096 x 384 rows, AMD EPYC Zen 4: probe 108-111 us when the helper was spinning,
/// 201-214 us when it slept, 146-185 us on the caller alone). 400 us covers the work
/// between two probes of back-to-back hybrid queries (150-200 us there), where at 200 us
/// 58 % of the probes found the helper asleep (12 % of dense ones); one query's p50 went from 0.33-0.39 to
/// 0.25-0.30 ms (hybrid), 0.51-0.58 to 0.47-0.54 (recollection), 0.17-0.21 to 0.17-0.19
/// (dense), six interleaved runs. After a region that followed an idle gap the helper
/// sleeps at once: a spin then made the next call after the gap slower (one query every
/// 2 ms: dense search p50 0.25-0.34 -> 0.49-0.53 ms on the 2-core EPYC Zen 5 VM, whatever
/// the spin's length or its pause instruction). In kAuto a helper also stops spinning once
/// idle_cpus() says no core is idle (another job's process on the other core: a 400 us
/// spin beside it made one query 10-28 % slower than a 200 us one, the stop took that
/// back). A spinning helper counts as awake (idle_cpus). The window runs from the later of
/// the helper's leaving its region and the last pool_keep_awake(). (_native.HELPER_SPIN_SECONDS)
constexpr double kHelperSpinSeconds = 400e-6;

/// CPUs of the machine that were idle at the last sample: online CPUs minus the tasks
/// running or runnable (/proc/loadavg's fourth field, which counts the caller), >= 0;
/// the online CPUs where /proc/loadavg cannot be read.
int idle_cpus();

/// The running-or-runnable tasks of a /proc/loadavg text ("0.52 0.58 0.59 2/99 1234": the
/// number before the '/'), -1 when the text is not of that form.
int loadavg_running(const char* text);

/// idle_cpus()'s formula: ``cpus`` when ``running`` < 0 (unknown), else
/// ``clamp(cpus - running + max(own, 0), 0, cpus)``, ``own`` the pool's awake helpers (the
/// machine's running tasks count them, but their cores are this process's).
int idle_count(int cpus, int running, int own);

/// Counters of the pool since the process started (or forked), for tests and benchmarks.
struct PoolCounters {
  int64_t regions;       // parallel regions run on the pool
  int64_t inline_taken;  // regions run on the caller alone because the pool was taken
  int64_t items_caller;  // items run by callers (tid 0) in pool regions
  int64_t items_helper;  // items run by helpers
  int64_t waits;         // regions whose caller had to sleep for a helper's item
  int64_t inline_busy;   // regions run on the caller alone because no core was idle (kAuto)
  int64_t idle_samples;  // samples of the machine's idle CPUs taken by idle_cpus()
  int64_t spin_regions;  // regions begun within kHelperSpinSeconds of the previous one's end: their
                         // helpers spin for the next region before they sleep
  int helpers;           // helper threads started
};
PoolCounters pool_counters();

/// Helpers awake now (running an item, or spinning for the next region after one; not
/// asleep on the condition variable): a region published now would find them at once.
int pool_awake_helpers();

/// Restarts the spin window (kHelperSpinSeconds) of the helpers awake now from this
/// moment (it marks the end of a region, as PoolCall's end after a gap does); nothing
/// when every helper sleeps. For single-threaded work that belongs to back-to-back calls:
/// the beam driver of one query (recollect.cpp) runs its rounds on the caller between the
/// probe of that query and the probe of the next, 200-300 us plus the search's Python
/// around them, so the next probe often found the helper asleep (one recollecting query
/// over 4,096 x 384 rows, AMD EPYC Zen 4, blocks of back-to-back queries, both rules in one
/// process: probe 151 -> 98 us, the search 0.520 -> 0.429 ms; 0.538-0.560 -> 0.500-0.520
/// ms in blocks alternating with mode "rfmem" and "dense"). A helper still stops at
/// idle_cpus() < 1 in kAuto.
void pool_keep_awake();

/// Multiply-adds below which a call that finds the helpers asleep after an idle gap (no
/// region within kHelperSpinSeconds; kAuto) runs on its caller alone instead of waking
/// them (PoolCall). A woken helper's vCPU is slow to start after a gap: one query over
/// 4,096 x 384 rows (1.6M multiply-adds) 2 ms after the previous one took 870 us (dense)
/// / 1,060 us (hybrid) on two threads against 680 / 840 us on one (AMD EPYC Zen 4, p50 of
/// 200).
constexpr double kAloneAfterGapWork = 4e6;

/// The threads one kernel call takes from the pool, decided before it cuts its work into
/// items (topk.cpp segmented_topk). From ``nthreads`` (threads_for's count for ``work``
/// multiply-adds), in kAuto: 1 for a call of fewer than kAloneAfterGapWork that finds the
/// helpers asleep with no region within kHelperSpinSeconds (an idle gap), whose end then
/// counts as a region's (the next call within the window is back to back: it uses the
/// pool and leaves the helpers spinning); 1 when no core is idle (idle_cpus(): the region
/// would run inline anyway, its work cut into items for threads it does not get: beside a
/// CPU-bound process one dense query over 4,096 x 384 rows took 245-269 us so against
/// 220-234 us alone, 215-231 us on one thread, the two alternating in one process); else
/// ``nthreads``. Other modes: ``nthreads``. Results never depend on it.
class PoolCall {
 public:
  PoolCall(int nthreads, double work);
  ~PoolCall();
  PoolCall(const PoolCall&) = delete;
  PoolCall& operator=(const PoolCall&) = delete;
  /// The threads the call takes, in [1, nthreads].
  int threads() const { return threads_; }

 private:
  int threads_;
  bool mark_end_ = false;
};

}  // namespace rfmem
