// One call of the collective as every kernel sees it: plain values and pointers, no FFI types.
#pragma once

#include <cstdint>

#include "cp_layout.h"
#include "region_layout.h"

namespace jax_cpgrad {

enum class OpKind : uint8_t { kGradReturn = 0, kAllGather = 1 };
inline const char* op_name(OpKind op) {
  return op == OpKind::kGradReturn ? "grad_return" : "all_gather";
}

enum class ElementType { kF32, kBF16, kF16 };

CPG_HOST_DEVICE inline int64_t element_bytes(ElementType t) {
  return t == ElementType::kF32 ? 4 : 2;
}

struct CallPlan {
  int64_t n = 1;        // CP size
  int64_t self = 0;     // this device's CP rank
  int64_t tensors = 1;  // how many tensors move together
  int64_t outer = 1;    // see Geometry
  int64_t run = 0;      // elements of one run
  int64_t set = 0;      // slot set of this call (epoch parity; the memop protocol's host sets it)
  int64_t slot_bytes = 0;  // stride between slots
  // The ranks whose data this call moves (the call's `reach` attribute): 0, every rank; k > 0,
  // only ranks self - k .. self + k (no wrap-around; 1 for a sliding window's halo). An
  // all-gather writes zeros for the others' chunks and a grad_return leaves their contributions
  // out of the sum. Every rank still publishes to and waits for every other, tile by tile, so
  // the epochs and the reuse of slots are ordered exactly as with 0.
  int64_t reach = 0;
  ElementType dtype = ElementType::kF32;
  // Test builds only (the race test's negative control): the owner waits this long before it
  // reads each tile (device protocol) or each call's slots (memop protocol). 0 otherwise.
  uint32_t test_finish_delay_ns = 0;
  CPG_HOST_DEVICE int64_t run_bytes() const { return run * element_bytes(dtype); }
  // One tensor in the local layout [outer, 2, run].
  CPG_HOST_DEVICE int64_t tensor_bytes() const { return outer * 2 * run_bytes(); }
  // What one writer sends one owner: every tensor's local share, one after another.
  CPG_HOST_DEVICE int64_t payload_bytes() const { return tensors * tensor_bytes(); }
  // The ranks in reach are first_in_reach() .. last_in_reach(), this one included.
  CPG_HOST_DEVICE int64_t first_in_reach() const {
    return reach == 0 || self < reach ? 0 : self - reach;
  }
  CPG_HOST_DEVICE int64_t last_in_reach() const {
    return reach == 0 || self + reach >= n ? n - 1 : self + reach;
  }
  CPG_HOST_DEVICE int64_t ranks_in_reach() const { return last_in_reach() - first_in_reach() + 1; }
  CPG_HOST_DEVICE bool in_reach(int64_t rank) const {
    return rank >= first_in_reach() && rank <= last_in_reach();
  }
};

struct TensorPtrs {
  const char* in[kMaxTensors];
  char* out[kMaxTensors];
};

// Every rank's shared memory as mapped on this device, by rank ([self] is our own).
struct PeerTable {
  char* header[kMaxRanks];
  char* slots[kMaxRanks];
};

// The p-th peer (p = 0..R-2) a writer sends to. Rotated by writer, so that at any moment every
// writer pushes into a different owner: with the same order on every writer all of them pushed
// into one owner at a time (incast), and 4 H200s reached 145-162 GB/s instead of 228-279.
CPG_HOST_DEVICE inline int64_t rotated_owner(int64_t self, int64_t n, int64_t p) {
  return (self + 1 + p) % n;
}

// The peers a writer sends data to (the memop protocol's scatters): every other rank in
// rotated order, or (reach > 0) the others in reach, lowest first.
CPG_HOST_DEVICE inline int64_t data_peer_count(const CallPlan& p) { return p.ranks_in_reach() - 1; }
CPG_HOST_DEVICE inline int64_t data_peer(const CallPlan& p, int64_t q) {
  if (p.reach == 0) return rotated_owner(p.self, p.n, q);
  const int64_t rank = p.first_in_reach() + q;
  return rank < p.self ? rank : rank + 1;
}

}  // namespace jax_cpgrad
