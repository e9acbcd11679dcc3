// One GPU's share of a workspace, as plain RAII C++ (no Python types): its own header and slots
// (region_layout.h), the mapped host words its kernels report to the watchdog through, and every
// peer's header and slots as mapped on this GPU (raw pointers with peer access, or CUDA IPC).
//
// Lifetime: close() frees the slots, the peer mappings and the host words, and marks the header
// closed; the header itself lives until the region is destroyed, because a CUDA graph recorded
// earlier may still replay a kernel that reads it (and then writes NaN and stops).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>

#include "call_plan.h"
#include "fused_kernels.h"

namespace jax_cpgrad {

// The two IPC handles a region exports (header, slots).
struct RegionHandles {
  cudaIpcMemHandle_t header;
  cudaIpcMemHandle_t slots;
};

class SymmetricRegion {
 public:
  // Allocates and initialises this GPU's memory (flags and epoch at `initial_epoch`); throws
  // std::runtime_error naming the problem (with advice when out of memory).
  SymmetricRegion(int device, int64_t rank, int64_t n, int64_t slot_bytes, uint32_t initial_epoch);
  ~SymmetricRegion();
  SymmetricRegion(const SymmetricRegion&) = delete;
  SymmetricRegion& operator=(const SymmetricRegion&) = delete;

  int device() const { return device_; }
  int64_t rank() const { return rank_; }
  RegionHandles export_handles() const;

  // Peer views; each returns "" on success or why the pair cannot be connected.
  std::string map_same_process(int64_t peer_rank, const SymmetricRegion& peer);
  std::string map_other_process(int64_t peer_rank, const RegionHandles& handles);
  bool connected() const;  // every rank's header and slots are mapped

  const PeerTable& peers() const { return peers_; }
  char* header() const { return header_; }
  HostReport* report() const { return report_; }                // host view
  HostReport* report_on_device() const { return report_dev_; }  // the same words, device view
  cudaStream_t side_stream() const { return side_stream_; }     // for setup and watchdog copies

  // Writes `values` into this GPU's Control block / flags (setup, watchdog and tests only: it
  // blocks the calling thread on the side stream).
  void write_header(int64_t offset, const void* values, int64_t bytes) const;
  void read_header(int64_t offset, void* values, int64_t bytes) const;

  // Waits for this GPU's queued work. Never throws: returns what failed, for the caller to report.
  std::vector<std::string> drain() const;
  // Waits again, marks the header closed, frees everything but the header. Never throws.
  std::vector<std::string> close();

 private:
  void release_all_but_header(std::vector<std::string>& problems);

  int device_;
  int64_t rank_, n_;
  char* header_ = nullptr;
  char* slots_ = nullptr;
  HostReport* report_ = nullptr;
  HostReport* report_dev_ = nullptr;
  cudaStream_t side_stream_ = nullptr;
  std::vector<void*> ipc_mapped_;  // peer memory opened from other processes
  PeerTable peers_{};
};

// IPC mappings currently open in this process (for the leak tests).
int64_t open_ipc_mappings();

}  // namespace jax_cpgrad
