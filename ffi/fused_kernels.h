// The device protocol: each call is ONE kernel that pushes, signals, waits and finishes, with
// the epoch kept in device memory. The host launches exactly the same kernel with the same
// arguments on every call, so the op can be recorded into a CUDA graph and replayed.
//
// Contract of fused_grad_return / fused_all_gather (one launch per call, on the caller's stream):
// - Launch shape: `blocks` blocks of kFusedThreads threads, all resident at once (at most the
//   workspace's SM budget, one block per SM fits). Blocks [0, push_blocks) push and signal;
//   blocks [blocks - finish_blocks, blocks) wait and finish. Either the two sets are disjoint
//   (specialised blocks) or every block does both, pushing first. A block pushes everything it
//   owes before it waits, so no wait depends on a block that cannot be scheduled.
// - Epoch: every block reads e = Control::epoch + 1 at its start; the last block to finish writes
//   Control::epoch = e (Control::blocks_done counts the finished blocks and is reset by it). No
//   host code counts calls.
// - Payload: what writer w sends owner o is cut into `tiles` tiles of tile_bytes (the last one may
//   be short). A pushing block copies tile t of owner o's share into o's slot w of set e % 2, in
//   rotated owner order, tile-major, then publishes flag[t * R + w] = e on o (system-scope
//   release after the tile's stores). A finishing block waits (acquire loads) for the flags of
//   tile t and then sums (grad_return: every writer of the tile, ordered float32 sum) or places
//   (all_gather: one writer's tile at a time) it, so finishing overlaps the transfer.
// - Deadline: every wait has one (timeout_ns from its start; 0 waits forever). On expiry the block
//   records the writers it never heard from in Control::missing, sets Control::state to
//   kStateFailed and reports the epoch to the host through HostReport; every other block stops
//   waiting when it sees the state. Never trap(): it would destroy XLA's CUDA context.
// - Small calls (payload at most kLLMaxPayload, runs a multiple of 8 bytes): the payload travels
//   as LL words instead (region_layout.h). A launch of ll_blocks blocks; each thread owns some
//   8-byte units of the payload: it sends each of them to every owner in rotated order, as one
//   16-byte volatile store {data, e, data, ~e} into the owner's LL slot w of set e % 2, then, for
//   the same units of its own payload, spins on each writer's word until it holds e and ~e and
//   sums (or places) it. No flag, no fence, no barrier between push and finish: what arrives is
//   the signal. This relies on each aligned 8-byte half of the store arriving whole (as NCCL's LL
//   protocol does), and checks both halves. The same epoch and failure rules; the deadline is
//   per thread, from its first wait of the call. Tensors need only element alignment.
// - Failure: when the state is not kStateOk at the start (a failed or closed workspace) or became
//   so during the call, the last block fills every output with NaN. A call that starts in such a
//   state touches no peer memory and no slot: only its own Control block and its outputs.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>

#include "call_plan.h"

namespace jax_cpgrad {

inline constexpr int kFusedThreads = 512;

// Written by the GPU into mapped pinned host memory, read by the watchdog without any CUDA call.
struct HostReport {
  uint32_t reached;    // memop protocol: epoch whose wait the stream arrived at
  uint32_t passed;     // memop protocol: epoch whose wait the stream passed
  uint32_t timed_out;  // device protocol: set when a kernel's wait expired (the call's
                       // epoch and missing writers are in Control)
};

// How a call is cut into tiles and blocks (the same on every call with the same shapes).
struct FusedShape {
  int64_t tile_bytes = 0;
  int64_t tiles = 0;
  int32_t blocks = 0;
  int32_t push_blocks = 0;
  int32_t finish_blocks = 0;
  int32_t ll_blocks = 0;  // > 0: the call may travel as LL words, with this many blocks
};

// block_budget: the most blocks (SMs) the kernel may occupy; push_blocks: how many of them push
// (the rest finish); push_blocks >= block_budget: every block pushes, then finishes.
FusedShape fused_shape(OpKind op, const CallPlan& plan, int32_t block_budget, int32_t push_blocks);

struct FusedCall {
  CallPlan plan;  // plan.set is ignored: the kernel takes the parity of its own epoch
  TensorPtrs t;
  PeerTable peers;
  HostReport* report;  // device view of the watchdog's words
  FusedShape shape;
  uint64_t timeout_ns;
  bool single_buffer;  // test builds only: always slot set 0, i.e. no write-after-read protection
};

// Launches the call as LL words when its plan allows it (shape.ll_blocks > 0; the plan is the
// same on every rank, so every rank picks the same wire format), otherwise as tiles.
cudaError_t launch_fused(OpKind op, const FusedCall& call, cudaStream_t stream);

// The LL kernels (fused_ll_kernels.cu); launch_fused decides when.
cudaError_t launch_fused_ll(OpKind op, const FusedCall& call, cudaStream_t stream);
bool ll_possible(const CallPlan& plan);
cudaError_t warm_fused_ll_kernels();

// Loads every device-protocol kernel now, so that CUDA's lazy loading never blocks inside a
// handler.
cudaError_t warm_fused_kernels();
// Loads the given kernels (what warm_fused_kernels does for each file's kernels).
cudaError_t load_kernels(std::initializer_list<const void*> kernels);

}  // namespace jax_cpgrad
