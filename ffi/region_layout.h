// Layout of one CP rank's symmetric region (one cudaMalloc, shared with the peers):
//
//   [flags page: int32 flag[kMaxRanks], int32 error word, padding]
//   [set 0: slot 0 .. slot N-1][set 1: slot 0 .. slot N-1]
//
// flag[w] is the last epoch writer w published to this rank. Slot w of a set holds what writer
// w sent this rank: every tensor of the call one after another, each in the local layout
// [outer, 2, run]. Calls alternate between the two sets by epoch parity (double buffering), so a
// writer's call e+2 can only reuse set e%2 after it has passed call e+1's wait, and every rank
// publishes e+1 only after it has finished reading set e%2: reuse is race-free by stream order.
#pragma once

#include <cstdint>

#include "cp_layout.h"

namespace jax_cpgrad {

inline constexpr int64_t kFlagsPageBytes = 1024;
inline constexpr int64_t kErrorWordOffset = 4 * kMaxRanks;
inline constexpr int64_t kSlotAlignment = 256;
static_assert(kErrorWordOffset + 4 <= kFlagsPageBytes, "flags page too small");

CPG_HOST_DEVICE inline int64_t slot_offset(int64_t n, int64_t slot_bytes, int64_t set,
                                           int64_t writer) {
  return kFlagsPageBytes + (set * n + writer) * slot_bytes;
}

inline int64_t region_bytes(int64_t n, int64_t slot_bytes) {
  return kFlagsPageBytes + 2 * n * slot_bytes;
}

inline int64_t round_up_slot_bytes(int64_t nbytes) {
  return (nbytes + kSlotAlignment - 1) / kSlotAlignment * kSlotAlignment;
}

}  // namespace jax_cpgrad
