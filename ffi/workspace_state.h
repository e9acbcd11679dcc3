// A workspace as the handlers and the watchdog see it: its fixed configuration, one
// SymmetricRegion per local GPU, whether it is closed or failed; and the registry of this
// process's open workspaces. Created by the bindings; held by the registry, by the Python
// Workspace until close(), and by every executable that instantiated a call on it (FFI state).
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <vector>

#include "call_plan.h"
#include "call_stream.h"
#include "symmetric_region.h"

namespace jax_cpgrad {

enum class Protocol : uint8_t { kStreamMemops = 0, kDevice = 1 };
const char* protocol_name(Protocol p);

struct WorkspaceConfig {
  std::string name;
  int64_t n = 1;
  int64_t slot_bytes = 0;
  double timeout_s = 600;  // 0: wait forever
  Protocol protocol = Protocol::kStreamMemops;
  int32_t block_budget = 0;  // device protocol: the most blocks (SMs) one call occupies
  int32_t push_blocks = 0;   // device protocol: how many of them push
  bool abort_on_timeout = false;
  bool overlap = false;  // calls run on the workspace's own stream, as start/done pairs
};

// One local GPU's part of a workspace.
struct Member {
  Member(int device, int64_t rank, const WorkspaceConfig& config, uint32_t initial_epoch)
      : region(device, rank, config.n, config.slot_bytes, initial_epoch),
        call_stream(config.overlap ? std::make_unique<CallStream>(device) : nullptr),
        epoch(initial_epoch) {}
  SymmetricRegion region;
  std::unique_ptr<CallStream> call_stream;  // overlap=True only
  std::atomic<uint32_t> epoch;              // memop protocol: the last epoch issued (host-side)
  std::atomic<uint32_t> test_finish_delay_ns{0};        // test builds only: see CallPlan
  std::array<std::atomic<uint8_t>, 256> op_of_epoch{};  // for messages: op kind by epoch % 256
};

struct WorkspaceState {
  WorkspaceState(int64_t id, WorkspaceConfig config) : id(id), config(std::move(config)) {}
  const int64_t id;
  const WorkspaceConfig config;
  std::vector<std::unique_ptr<Member>> members;
  // Test builds only (JAX_CPGRAD_TEST_HOOKS): every call uses slot set 0, which removes the
  // write-after-read protection, so that the race test can show it then fails.
  std::atomic<bool> single_buffer{false};
  // Test builds only: the dones of overlapped calls do not wait (the overlap test's negative
  // control: results are then read before they are complete).
  std::atomic<bool> test_skip_join{false};

  // Handlers hold it shared while they check `closed` and enqueue, the watchdog while it polls;
  // begin_close() and finish_close() hold it exclusively.
  mutable std::shared_mutex mu;
  bool closed = false;    // no call is enqueued any more
  bool released = false;  // the memory is freed (but the headers; see region_layout.h)

  std::atomic<bool> failed{false};
  void fail(const std::string& why);
  std::string failure_text() const;

  Member* member_for_device(int device) const;
  // Closing is collective and goes in two steps, with a barrier of every process between them
  // (no peer may still write into our memory when we free it): begin_close() refuses further
  // calls and waits for this process's GPUs (the watchdog still releases a wait stuck on a dead
  // peer meanwhile); finish_close() frees everything but the headers. Both return what failed
  // (they never throw).
  std::vector<std::string> begin_close();
  std::vector<std::string> finish_close();

 private:
  mutable std::mutex failure_mu_;
  std::string failure_;
};

// The open workspaces of this process, by id: what an executable's instantiate stage looks up,
// and what the watchdog polls.
class Registry {
 public:
  static Registry& get();
  void add(std::shared_ptr<WorkspaceState> ws);
  void remove(int64_t id);
  std::shared_ptr<WorkspaceState> find(int64_t id) const;
  std::vector<std::shared_ptr<WorkspaceState>> all() const;

 private:
  mutable std::mutex mu_;
  std::vector<std::shared_ptr<WorkspaceState>> workspaces_;
};

}  // namespace jax_cpgrad
