#include "watchdog.h"

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <vector>

#include "peer_registry.h"
#include "region_layout.h"

namespace jax_cpgrad {
namespace {

using Clock = std::chrono::steady_clock;
constexpr auto kPollInterval = std::chrono::milliseconds(10);

// Watch state of one member, kept by the watchdog thread only.
struct Watch {
  const Member* member = nullptr;
  uint32_t epoch = 0;
  Clock::time_point since;
};

std::mutex g_mu;
std::condition_variable g_cv;
bool g_stop = false;
std::thread* g_thread = nullptr;

// Makes every wait issued so far on `m` pass and marks their outputs failed (NaN).
void release(const WorkspaceState& ws, const Member& m) {
  cudaSetDevice(m.device);
  static const int one = 1;
  cudaMemcpyAsync(m.own_region + kErrorWordOffset, &one, sizeof(one), cudaMemcpyHostToDevice,
                  m.watchdog_stream);
  std::vector<uint32_t> flags(ws.n, m.epoch.load());
  cudaMemcpyAsync(m.own_region, flags.data(), 4 * flags.size(), cudaMemcpyHostToDevice,
                  m.watchdog_stream);
  cudaStreamSynchronize(m.watchdog_stream);  // watchdog thread, its own stream: never blocks a handler
}

// (No iostreams here: a locale-dependent stream in this thread crashed inside libstdc++.)
std::string describe_timeout(const WorkspaceState& ws, const Member& m, uint32_t epoch) {
  cudaSetDevice(m.device);
  std::vector<uint32_t> flags(ws.n, 0);
  cudaMemcpyAsync(flags.data(), m.own_region, 4 * flags.size(), cudaMemcpyDeviceToHost,
                  m.watchdog_stream);
  cudaStreamSynchronize(m.watchdog_stream);  // watchdog thread, its own stream: never blocks a handler
  std::string missing, last;
  for (int64_t w = 0; w < ws.n; ++w) {
    if (w == m.rank || static_cast<int32_t>(flags[w] - epoch) >= 0) continue;
    const std::string sep = missing.empty() ? "" : ", ";
    missing += sep + std::to_string(w);
    last += sep + "rank " + std::to_string(w) + " at " + std::to_string(flags[w]);
  }
  const auto op = static_cast<OpKind>(m.op_of_epoch[epoch % m.op_of_epoch.size()].load());
  char timeout[32];
  std::snprintf(timeout, sizeof(timeout), "%g", ws.timeout_s);
  return std::string("jax_cpgrad: ") + op_name(op) + " call with epoch " + std::to_string(epoch) +
         " on workspace '" + ws.name + "' timed out after " + timeout + " s on CP rank " +
         std::to_string(m.rank) + " of " + std::to_string(ws.n) + " (GPU " + std::to_string(m.device) +
         "): CP ranks [" + missing + "] never arrived (last epochs they published: " + last +
         "). A peer process probably died, hung, or skipped a call. The outputs of that call are "
         "NaN and this workspace is now unusable. Set the timeout with "
         "Workspace(..., timeout_s=...) or JAX_CPGRAD_TIMEOUT_S.";
}

void poll_once(std::vector<Watch>& watches) {
  auto lock = Registry::get().read_lock();
  const auto now = Clock::now();
  std::vector<Watch> next;
  Registry::get().for_each([&](WorkspaceState& ws) {
    for (const auto& mp : ws.members) {
      const Member& m = *mp;
      const uint32_t reached = *static_cast<volatile const uint32_t*>(&m.progress->reached);
      const uint32_t passed = *static_cast<volatile const uint32_t*>(&m.progress->passed);
      if (reached == passed) continue;  // not inside a wait
      if (ws.failed.load()) {           // a wait issued around or after the failure
        release(ws, m);
        continue;
      }
      Watch w{&m, reached, now};
      for (const Watch& old : watches) {
        if (old.member == &m && old.epoch == reached) w.since = old.since;
      }
      if (ws.timeout_s > 0 && now - w.since > std::chrono::duration<double>(ws.timeout_s)) {
        const std::string why = describe_timeout(ws, m, reached);
        ws.fail(why);
        std::fprintf(stderr, "%s\n", why.c_str());
        std::fflush(stderr);
        if (const char* abort_env = std::getenv("JAX_CPGRAD_ABORT_ON_TIMEOUT");
            abort_env && std::string(abort_env) == "1") {
          std::abort();
        }
        release(ws, m);
        continue;
      }
      next.push_back(w);
    }
  });
  watches.swap(next);
}

void run() {
  std::vector<Watch> watches;
  std::unique_lock lock(g_mu);
  while (!g_stop) {
    g_cv.wait_for(lock, kPollInterval, [] { return g_stop; });
    if (g_stop) break;
    lock.unlock();
    poll_once(watches);
    lock.lock();
  }
}

}  // namespace

void watchdog_start() {
  std::lock_guard lock(g_mu);
  if (g_thread != nullptr) return;
  g_stop = false;
  g_thread = new std::thread(run);
}

void watchdog_stop() {
  std::thread* thread = nullptr;
  {
    std::lock_guard lock(g_mu);
    g_stop = true;
    std::swap(thread, g_thread);
  }
  g_cv.notify_all();
  if (thread != nullptr) {
    thread->join();
    delete thread;
  }
}

}  // namespace jax_cpgrad
