// The memory one CP rank shares with its peers: two allocations per device.
//
//   header: [Control][flags: uint32 flag[tile * R + writer], kMaxTiles * R of them]
//           [LL slots: set 0: slot 0 .. slot R-1][set 1: ...], ll_slot_bytes(slot_bytes) each
//   slots:  [set 0: slot 0 .. slot R-1][set 1: slot 0 .. slot R-1]
//
// flag[t * R + w] is the last epoch writer w published for tile t of this rank's slots (the
// memop protocol uses tile 0 only). Slot w of a set holds what writer w sent this rank:
// every tensor of the call one after another, each in the local layout [outer, 2, run]. Calls
// alternate between the two sets by epoch parity (double buffering): a writer's call e+2 reuses
// set e%2 only after its call e+1 received every peer's contribution, and each peer sent those
// after it had finished call e, reading set e%2, on its stream. So reuse is race-free by stream
// order, without a round trip on the critical path.
//
// LL slots (the device protocol's small calls, fused_kernels.h) hold 16-byte words {data, e,
// data, ~e}: the reader knows a word has arrived when they hold the call's epoch e and its
// complement, so no flag and no fence is needed. A uniformly filled word (the initial fill) never
// matches, whatever the epoch; a word last written by the call 2^32 calls earlier would (the tile
// flags have the same 2^31-call horizon). They are kept apart from the raw slots so that raw data
// left there by a larger call can never look like an arrived word. The same parity sets make
// their reuse safe.
//
// The header outlives the slots: a workspace frees its slots at close(), but an executable that
// recorded the device protocol into a CUDA graph may replay it later; the replayed kernel reads
// Control::state (kClosed), writes NaN outputs and touches nothing else.
#pragma once

#include <cstdint>

#include "cp_layout.h"

namespace jax_cpgrad {

// Control::state values.
inline constexpr uint32_t kStateOk = 0;
inline constexpr uint32_t kStateFailed = 1;  // a call timed out: outputs NaN from then on
inline constexpr uint32_t kStateClosed = 2;  // Workspace.close() ran: outputs NaN, no peer access

// The most signal tiles one call is cut into (it bounds the flags' memory).
inline constexpr int64_t kMaxTiles = 2048;

struct Control {
  uint32_t epoch;  // device protocol: the last epoch this device finished (kernels advance it)
  uint32_t state;  // kStateOk / kStateFailed / kStateClosed
  uint32_t blocks_done;   // device protocol: blocks of the running call that have finished
  uint32_t failed_epoch;  // the epoch of the call that timed out
  uint32_t missing[kMaxRanks / 32];  // writers a timed-out call never heard from (bit per rank)
};

inline constexpr int64_t kControlBytes = 256;
static_assert(sizeof(Control) <= kControlBytes, "control block too large");
inline constexpr int64_t kSlotAlignment = 256;

// The largest payload (what one writer sends one owner) that travels as LL words; LL doubles the
// bytes on the wire, so larger calls move raw data and signal with tile flags. An LL word carries
// kLLUnitBytes of payload in kLLWordBytes.
inline constexpr int64_t kLLMaxPayload = 256 * 1024;
inline constexpr int64_t kLLUnitBytes = 8;
inline constexpr int64_t kLLWordBytes = 16;

// One writer's LL slot: room for the largest LL payload that fits a data slot of slot_bytes.
CPG_HOST_DEVICE inline int64_t ll_slot_bytes(int64_t slot_bytes) {
  return (slot_bytes < kLLMaxPayload ? slot_bytes : kLLMaxPayload) / kLLUnitBytes * kLLWordBytes;
}

CPG_HOST_DEVICE inline int64_t flags_bytes(int64_t n) { return 4 * kMaxTiles * n; }

// Where the LL slots lie in a header, and how many bytes they take.
CPG_HOST_DEVICE inline int64_t ll_area_offset(int64_t n) { return kControlBytes + flags_bytes(n); }
CPG_HOST_DEVICE inline int64_t ll_area_bytes(int64_t n, int64_t slot_bytes) {
  return 2 * n * ll_slot_bytes(slot_bytes);
}

CPG_HOST_DEVICE inline int64_t header_bytes(int64_t n, int64_t slot_bytes) {
  return ll_area_offset(n) + ll_area_bytes(n, slot_bytes);
}

CPG_HOST_DEVICE inline uint32_t* flags_of(char* header) {
  return reinterpret_cast<uint32_t*>(header + kControlBytes);
}

// Writer `writer`'s LL slot of set `set` in the header `header`.
CPG_HOST_DEVICE inline char* ll_slot_of(char* header, int64_t n, int64_t slot_bytes, int64_t set,
                                        int64_t writer) {
  return header + ll_area_offset(n) + (set * n + writer) * ll_slot_bytes(slot_bytes);
}

CPG_HOST_DEVICE inline int64_t slot_offset(int64_t n, int64_t slot_bytes, int64_t set,
                                           int64_t writer) {
  return (set * n + writer) * slot_bytes;
}

inline int64_t slots_bytes(int64_t n, int64_t slot_bytes) { return 2 * n * slot_bytes; }

// Device memory of one rank: what workspace_bytes() reports.
inline int64_t region_bytes(int64_t n, int64_t slot_bytes) {
  return header_bytes(n, slot_bytes) + slots_bytes(n, slot_bytes);
}

inline int64_t round_up_slot_bytes(int64_t nbytes) {
  return (nbytes + kSlotAlignment - 1) / kSlotAlignment * kSlotAlignment;
}

}  // namespace jax_cpgrad
