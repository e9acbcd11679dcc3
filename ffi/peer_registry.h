// The workspaces of this process: per local device, its own symmetric region, every peer's
// region as mapped on that device, and the host-side epoch. Created and destroyed by setup code
// (workspace_bindings.cc); looked up by the handlers and the watchdog.
#pragma once

#include <cuda_runtime.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <vector>

#include "kernels.h"

namespace jax_cpgrad {

enum class OpKind : uint8_t { kGradReturn = 0, kAllGather = 1 };
const char* op_name(OpKind op);

// Written by the GPU (stream memory ops into mapped pinned memory), read by the watchdog:
// `reached` when the stream arrives at a call's wait, `passed` when all peers have arrived.
struct ProgressWords {
  uint32_t reached;  // read by the host through volatile loads (the GPU writes them)
  uint32_t passed;
};

// One local device's part of a workspace.
struct Member {
  int device = 0;        // CUDA ordinal (what the handler's DeviceOrdinal reports)
  int64_t rank = 0;      // index along the CP axis
  char* own_region = nullptr;
  RegionTable regions{};             // every rank's region as mapped on this device
  std::vector<void*> ipc_mapped;     // regions opened from other processes
  ProgressWords* progress = nullptr;  // host view (mapped pinned memory)
  void* progress_device = nullptr;    // device view of the same words
  cudaStream_t watchdog_stream = nullptr;
  std::atomic<uint32_t> epoch{0};     // last epoch issued on this device
  std::array<std::atomic<uint8_t>, 256> op_of_epoch{};  // for messages: op kind by epoch % 256
};

struct WorkspaceState {
  int64_t id = 0;
  std::string name;
  int64_t n = 1;
  int64_t slot_bytes = 0;
  double timeout_s = 600;
  // Test-only (JAX_CPGRAD_UNSAFE_SINGLE_BUFFER=1): every call uses slot set 0, which removes the
  // write-after-read protection; the race test shows that results then go wrong.
  bool unsafe_single_buffer = false;
  std::vector<std::unique_ptr<Member>> members;

  std::atomic<bool> failed{false};
  mutable std::mutex failure_mu;
  std::string failure;  // why the workspace is unusable (set once, by the watchdog)

  Member* member_for_device(int device) const;
  void fail(const std::string& why);
  std::string failure_text() const;
};

// The registry: handlers and the watchdog hold the shared lock while they use a workspace;
// closing takes it exclusively, so memory is never freed under a call being enqueued.
class Registry {
 public:
  static Registry& get();
  void add(std::shared_ptr<WorkspaceState> ws);
  std::shared_ptr<WorkspaceState> remove(int64_t id);
  std::shared_lock<std::shared_mutex> read_lock() const { return std::shared_lock(mu_); }
  // Caller holds read_lock().
  WorkspaceState* find(int64_t id) const;
  template <typename Fn> void for_each(Fn&& fn) const {  // caller holds read_lock()
    for (const auto& ws : workspaces_) fn(*ws);
  }

 private:
  mutable std::shared_mutex mu_;
  std::vector<std::shared_ptr<WorkspaceState>> workspaces_;
};

}  // namespace jax_cpgrad
