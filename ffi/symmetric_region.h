// One GPU's share of a workspace, as plain RAII C++ (no Python types): its own header and slots
// (region_layout.h, each a VmmMapping), the mapped host words its kernels report to the watchdog
// through, and every peer's header and slots as mapped on this GPU: a peer in this process grants
// this GPU access to its own allocations; a peer in another process sends them as file
// descriptors (the Python side passes them over a Unix socket) and this region maps them.
//
// Lifetime: close() unmaps the slots and the peer mappings, frees the host words, and marks the
// header closed; the header itself stays mapped until the region is destroyed, because a CUDA
// graph recorded earlier may still replay a kernel that reads it (and then writes NaN and stops).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "call_plan.h"
#include "fused_kernels.h"
#include "vmm_memory.h"

namespace jax_cpgrad {

// What another process of the job needs to map a region: its two allocations as file
// descriptors (whoever holds this owns and closes them) and their sizes.
struct RegionExport {
  int header_fd = -1;
  int64_t header_bytes = 0;
  int slots_fd = -1;
  int64_t slots_bytes = 0;
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
  // New descriptors of this GPU's header and slots; throws std::runtime_error where the GPU
  // cannot export memory as file descriptors.
  RegionExport export_memory() const;

  // Peer views; each returns "" on success or why the pair cannot be connected.
  std::string map_same_process(int64_t peer_rank, const SymmetricRegion& peer);
  std::string map_other_process(int64_t peer_rank, const RegionExport& peer);
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
  int64_t rank_, n_, slot_bytes_;
  bool exportable_ = false;  // the GPU can export memory as file descriptors
  std::unique_ptr<VmmMapping> header_mem_, slots_mem_;
  char* header_ = nullptr;  // header_mem_'s address, while it is mapped
  HostReport* report_ = nullptr;
  HostReport* report_dev_ = nullptr;
  cudaStream_t side_stream_ = nullptr;
  std::vector<std::unique_ptr<VmmMapping>> peer_mem_;  // memory of peers in other processes
  PeerTable peers_{};
};

// Mappings of other processes' memory currently open in this process (for the leak tests).
int64_t open_peer_mappings();

}  // namespace jax_cpgrad
