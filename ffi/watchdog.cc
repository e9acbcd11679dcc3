#include "watchdog.h"

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <vector>

#include "workspace_state.h"

namespace jax_cpgrad {
namespace {

using Clock = std::chrono::steady_clock;
constexpr auto kPollInterval = std::chrono::milliseconds(10);

// Watch state of one member at a stream wait, kept by the watchdog thread only.
struct Watch {
  const Member* member = nullptr;
  uint32_t epoch = 0;
  Clock::time_point since;
};

std::mutex g_mu;
std::condition_variable g_cv;
bool g_stop = false;
std::thread* g_thread = nullptr;
std::mutex g_report_mu;  // one thread turns a device report into the failure

uint32_t read_host_word(const uint32_t& word) {
  return *static_cast<volatile const uint32_t*>(&word);
}

// Memop protocol: makes every wait issued so far on `m` pass and marks their outputs failed
// (NaN). The copies run on the region's side stream: this never blocks a handler.
void release(const WorkspaceState& ws, const Member& m) {
  try {
    const uint32_t failed = kStateFailed;
    m.region.write_header(offsetof(Control, state), &failed, sizeof(failed));
    std::vector<uint32_t> flags(ws.config.n, m.epoch.load());
    m.region.write_header(kControlBytes, flags.data(), 4 * flags.size());
  } catch (const std::exception& err) {
    std::fprintf(stderr, "jax_cpgrad: the watchdog could not release a stuck wait: %s\n",
                 err.what());
  }
}

// `what`: the op's name where the host knows it (memop protocol), "collective" otherwise.
std::string timeout_message(const WorkspaceState& ws, const Member& m, const char* what,
                            uint32_t epoch, const std::string& missing, const std::string& detail) {
  char timeout[32];
  std::snprintf(timeout, sizeof(timeout), "%g", ws.config.timeout_s);
  return std::string("jax_cpgrad: ") + what + " call with epoch " + std::to_string(epoch) +
         " on workspace '" + ws.config.name + "' timed out after " + timeout + " s on CP rank " +
         std::to_string(m.region.rank()) + " of " + std::to_string(ws.config.n) + " (GPU " +
         std::to_string(m.region.device()) + "): CP ranks [" + missing + "] never arrived (" +
         detail +
         "). A peer process probably died, hung, or skipped a call. The outputs of that call are "
         "NaN and this workspace is now unusable. Set the timeout with Workspace(..., "
         "timeout_s=...) or "
         "JAX_CPGRAD_TIMEOUT_S.";
}

// (No iostreams here: a locale-dependent stream in this thread crashed inside libstdc++.)
std::string describe_stream_timeout(const WorkspaceState& ws, const Member& m, uint32_t epoch) {
  std::vector<uint32_t> flags(ws.config.n, 0);
  m.region.read_header(kControlBytes, flags.data(), 4 * flags.size());
  std::string missing, last;
  for (int64_t w = 0; w < ws.config.n; ++w) {
    if (w == m.region.rank() || static_cast<int32_t>(flags[w] - epoch) >= 0) continue;
    const std::string sep = missing.empty() ? "" : ", ";
    missing += sep + std::to_string(w);
    last += sep + "rank " + std::to_string(w) + " at " + std::to_string(flags[w]);
  }
  const auto op = static_cast<OpKind>(m.op_of_epoch[epoch % m.op_of_epoch.size()].load());
  return timeout_message(ws, m, op_name(op), epoch, missing, "last epochs they published: " + last);
}

std::string describe_device_timeout(const WorkspaceState& ws, const Member& m) {
  Control control{};
  m.region.read_header(0, &control, sizeof(control));
  std::string missing;
  for (int64_t w = 0; w < ws.config.n; ++w) {
    if (control.missing[w / 32] & (1u << (w % 32)))
      missing += (missing.empty() ? "" : ", ") + std::to_string(w);
  }
  // The host does not see the device protocol's calls, so it cannot name the op.
  return timeout_message(ws, m, "collective", control.failed_epoch, missing,
                         "device protocol: their data for that call never arrived");
}

void report_timeout(WorkspaceState& ws, const std::string& why) {
  ws.fail(why);
  std::fprintf(stderr, "%s\n", why.c_str());
  std::fflush(stderr);
  if (ws.config.abort_on_timeout) std::abort();
}

// Memop protocol: tracks how long `m` has sat at the same wait; past the timeout, reports
// the call and releases the wait.
void poll_stream_wait(WorkspaceState& ws, const Member& m, const Clock::time_point now,
                      std::vector<Watch>& watches, std::vector<Watch>& next) {
  const HostReport& report = *m.region.report();
  const uint32_t reached = read_host_word(report.reached);
  if (reached == read_host_word(report.passed)) return;  // not inside a wait
  if (ws.failed.load()) {  // a wait issued around or after the failure
    release(ws, m);
    return;
  }
  Watch w{&m, reached, now};
  for (const Watch& old : watches) {
    if (old.member == &m && old.epoch == reached) w.since = old.since;
  }
  if (ws.config.timeout_s > 0 &&
      now - w.since > std::chrono::duration<double>(ws.config.timeout_s)) {
    report_timeout(ws, describe_stream_timeout(ws, m, reached));
    release(ws, m);
    return;
  }
  next.push_back(w);
}

void poll_once(std::vector<Watch>& watches) {
  const auto now = Clock::now();
  std::vector<Watch> next;
  for (const auto& ws : Registry::get().all()) {
    std::shared_lock lock(ws->mu);  // close() cannot free the report words under us
    if (ws->released) continue;
    if (ws->config.protocol == Protocol::kDevice) {
      sync_device_failure(*ws);
      continue;
    }
    for (const auto& m : ws->members) poll_stream_wait(*ws, *m, now, watches, next);
  }
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

bool sync_device_failure(WorkspaceState& ws) {
  if (ws.failed.load()) return true;
  for (const auto& m : ws.members) {
    if (m->region.report() == nullptr || read_host_word(m->region.report()->timed_out) == 0)
      continue;
    std::lock_guard lock(g_report_mu);
    if (!ws.failed.load()) report_timeout(ws, describe_device_timeout(ws, *m));
    return true;
  }
  return false;
}

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
