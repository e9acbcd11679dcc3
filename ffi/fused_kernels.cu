// The device protocol's kernels. The contract (launch shape, epoch, tiles, deadline, failure) is
// written in fused_kernels.h.
#include <algorithm>

#include "device/call_lifecycle.cuh"
#include "device/ordered_sum.cuh"
#include "device/row_copy.cuh"
#include "device/signal.cuh"
#include "fused_kernels.h"

namespace jax_cpgrad {
namespace {

constexpr int kCopyUnroll = 4;  // 16-byte vectors in flight per thread in a push
constexpr int kSumUnroll = 2;   // per writer, in the sum (times 4 writers in flight: see sum_words)
constexpr int64_t kTileAlign = 4096;
// Small enough that a 64 KiB message still spreads over several blocks, large enough that a
// flag (a barrier and one remote release) is rare next to the data.
constexpr int64_t kMinTileBytes = 16384;
constexpr unsigned kFullWarp = 0xffffffffu;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

__device__ __forceinline__ int64_t tile_end(const FusedCall& c, int64_t t) {
  return min(c.plan.payload_bytes(), (t + 1) * c.shape.tile_bytes);
}

// Marks the call failed: the writers of tile t that never arrived go into Control::missing, the
// state becomes kStateFailed (the other blocks stop waiting) and the host hears of it. Warp 0.
__device__ void fail_call(const FusedCall& c, Control* ctrl, uint32_t e, const uint32_t* flags,
                          int64_t only) {
  const unsigned lane = threadIdx.x;
  for (int64_t w = lane; w < c.plan.n; w += 32) {
    const bool selected = only < 0 ? w != c.plan.self : w == only;
    if (selected && !epoch_reached(acquire_load(&flags[w]), e))
      atomicOr(&ctrl->missing[w / 32], 1u << (w % 32));
  }
  __syncwarp();
  if (lane == 0) declare_failed(c, ctrl, e);
}

// Waits until the flags of tile t hold epoch e for every writer but us (only < 0) or for writer
// `only`. Warp 0 polls; the verdict is the block's: false when the call failed (our deadline
// expired, or another block's did).
__device__ bool wait_for_tile(const FusedCall& c, Control* ctrl, uint32_t e, int64_t t,
                              int64_t only) {
  __shared__ int ready;
  __syncthreads();  // every thread has read the previous verdict
  if (threadIdx.x < 32) {
    const unsigned lane = threadIdx.x;
    const uint32_t* flags = flags_of(c.peers.header[c.plan.self]) + t * c.plan.n;
    unsigned long long deadline = 0;
    int verdict = 1;
    while (true) {
      bool arrived = true;
      for (int64_t w = lane; w < c.plan.n; w += 32) {
        const bool selected = only < 0 ? w != c.plan.self : w == only;
        if (selected && !epoch_reached(acquire_load(&flags[w]), e)) arrived = false;
      }
      if (__all_sync(kFullWarp, arrived)) break;
      // Decisions are warp-uniform: taken on lane 0's reads.
      const uint32_t state =
          __shfl_sync(kFullWarp, lane == 0 ? volatile_load(&ctrl->state) : 0u, 0);
      if (state != kStateOk) {
        verdict = 0;
        break;
      }
      if (c.timeout_ns == 0) continue;
      const unsigned long long now =
          __shfl_sync(kFullWarp, lane == 0 ? global_timer_ns() : 0ull, 0);
      if (deadline == 0) {
        deadline = now + c.timeout_ns;
      } else if (now > deadline) {
        fail_call(c, ctrl, e, flags, only);
        verdict = 0;
        break;
      }
    }
    if (lane == 0) ready = verdict;
  }
  __syncthreads();
  return ready != 0;
}

// This block's index among the finishing blocks (negative: it does not finish).
__device__ __forceinline__ int64_t finisher_index(const FusedCall& c) {
  return int64_t(blockIdx.x) - (c.shape.blocks - c.shape.finish_blocks);
}

// A pushing block's share of the call: items (tile t, peer p), tile-major, peers in rotated
// order. Each item copies tile t of what this rank owes the owner through the row map
// rows_for(owner, our slot on the owner), unless the owner is out of the call's reach, and then
// publishes the tile's flag there (to every owner: the flags order the epochs and the slots).
template <typename Word, typename RowsFor>
__device__ void push_tiles(const FusedCall& c, uint32_t e, int64_t set, int64_t row_bytes,
                           RowsFor rows_for) {
  const CallPlan& p = c.plan;
  const int64_t items = (p.n - 1) * c.shape.tiles;
  for (int64_t item = blockIdx.x; item < items; item += c.shape.push_blocks) {
    const int64_t t = item / (p.n - 1);
    const int64_t owner = rotated_owner(p.self, p.n, item % (p.n - 1));
    char* slot = c.peers.slots[owner] + slot_offset(p.n, p.slot_bytes, set, p.self);
    if (p.in_reach(owner)) {
      block_copy_range<Word, kCopyUnroll>(rows_for(owner, slot), row_bytes, t * c.shape.tile_bytes,
                                          tile_end(c, t));
    }
    block_publish(flags_of(c.peers.header[owner]) + t * p.n + p.self, e);
  }
}

// ---------------------------------------------------------------------------------------------
// grad_return: owner o's payload from writer w is, row by row (row = tensor k, outer b, half h),
// chunk chunk_of(o, h) of w's global input; the owner sums the R rows of each tile in order.

template <typename Word>
__device__ void push_owner_chunks(const FusedCall& c, uint32_t e, int64_t set) {
  const CallPlan& p = c.plan;
  const int64_t rb = p.run_bytes();
  push_tiles<Word>(c, e, set, rb, [&](int64_t owner, char* slot) {
    return [&, owner, slot](int64_t row, const char** src, char** dst) {
      const int64_t h = row % 2, b = (row / 2) % p.outer, k = row / (2 * p.outer);
      *src = c.t.in[k] + (b * 2 * p.n + chunk_of(owner, h, p.n)) * rb;
      *dst = slot + row * rb;
    };
  });
}

template <typename T, typename Word>
__device__ void sum_arrived_tiles(const FusedCall& c, Control* ctrl, uint32_t e, int64_t set) {
  const CallPlan& p = c.plan;
  const int64_t rb = p.run_bytes();
  const char* slot0 = c.peers.slots[p.self] + slot_offset(p.n, p.slot_bytes, set, 0);
  for (int64_t t = finisher_index(c); t < c.shape.tiles; t += c.shape.finish_blocks) {
    if (!wait_for_tile(c, ctrl, e, t, -1)) return;
    spin_for_ns(p.test_finish_delay_ns);
    for_each_row_segment(
        rb, t * c.shape.tile_bytes, tile_end(c, t), [&](int64_t row, int64_t a, int64_t b) {
          const int64_t h = row % 2, bo = (row / 2) % p.outer, k = row / (2 * p.outer);
          const Contributions<Word> in{
              reinterpret_cast<const Word*>(c.t.in[k] +
                                            (bo * 2 * p.n + chunk_of(p.self, h, p.n)) * rb + a),
              slot0 + row * rb + a,
              p.slot_bytes,
              p.first_in_reach(),
              p.ranks_in_reach(),
              p.self};
          Word* out = reinterpret_cast<Word*>(c.t.out[k] + (bo * 2 + h) * rb + a);
          const int64_t words = (b - a) / static_cast<int64_t>(sizeof(Word));
          for (int64_t base = threadIdx.x; base < words;
               base += int64_t(kFusedThreads) * kSumUnroll) {
            sum_words<T, Word, kSumUnroll, kFusedThreads>(in, out, base, words);
          }
        });
  }
}

template <typename T, typename Word>
__global__ void __launch_bounds__(kFusedThreads) fused_grad_return(FusedCall c) {
  run_call(c, OpKind::kGradReturn, [&](Control* ctrl, uint32_t e) {
    const int64_t set = slot_set(c, e);
    if (blockIdx.x < c.shape.push_blocks) push_owner_chunks<Word>(c, e, set);
    if (finisher_index(c) >= 0) sum_arrived_tiles<T, Word>(c, ctrl, e, set);
  });
}

// ---------------------------------------------------------------------------------------------
// all_gather: writer w sends every peer its whole local input (the tensors one after another);
// the owner places each writer's tile, as soon as it has arrived, at chunks (w, 2R-1-w), or
// zeros there for a writer out of the call's reach (whose tile flag it still waits for).

template <typename Word>
__device__ void push_local_copies(const FusedCall& c, uint32_t e, int64_t set) {
  const int64_t tb = c.plan.tensor_bytes();
  push_tiles<Word>(c, e, set, tb, [&](int64_t, char* slot) {
    return [&, slot](int64_t k, const char** src, char** dst) {
      *src = c.t.in[k];
      *dst = slot + k * tb;
    };
  });
}

template <typename Word>
__device__ void place_arrived_tiles(const FusedCall& c, Control* ctrl, uint32_t e, int64_t set) {
  const CallPlan& p = c.plan;
  const int64_t rb = p.run_bytes();
  const int64_t items = c.shape.tiles * p.n;
  for (int64_t item = finisher_index(c); item < items; item += c.shape.finish_blocks) {
    const int64_t t = item / p.n;
    const int64_t w = (p.self + item % p.n) % p.n;  // our own tile first: it needs no wait
    if (w != p.self && !wait_for_tile(c, ctrl, e, t, w)) return;
    spin_for_ns(p.test_finish_delay_ns);
    const char* slot = c.peers.slots[p.self] + slot_offset(p.n, p.slot_bytes, set, w);
    const bool zeros = !p.in_reach(w);
    const auto rows = [&](int64_t row, const char** src, char** dst) {
      const int64_t h = row % 2, b = (row / 2) % p.outer, k = row / (2 * p.outer);
      *src = zeros ? nullptr : w == p.self ? c.t.in[k] + (b * 2 + h) * rb : slot + row * rb;
      *dst = c.t.out[k] + (b * 2 * p.n + chunk_of(w, h, p.n)) * rb;
    };
    block_copy_range<Word, kCopyUnroll>(rows, rb, t * c.shape.tile_bytes, tile_end(c, t));
  }
}

template <typename Word>
__global__ void __launch_bounds__(kFusedThreads) fused_all_gather(FusedCall c) {
  run_call(c, OpKind::kAllGather, [&](Control* ctrl, uint32_t e) {
    const int64_t set = slot_set(c, e);
    if (blockIdx.x < c.shape.push_blocks) push_local_copies<Word>(c, e, set);
    if (finisher_index(c) >= 0) place_arrived_tiles<Word>(c, ctrl, e, set);
  });
}

// ---------------------------------------------------------------------------------------------

bool all_aligned(const FusedCall& c, int64_t bytes) {
  bool ok = c.plan.run_bytes() % bytes == 0 && c.plan.slot_bytes % bytes == 0;
  for (int64_t k = 0; k < c.plan.tensors; ++k) {
    ok = ok && reinterpret_cast<uintptr_t>(c.t.in[k]) % bytes == 0 &&
         reinterpret_cast<uintptr_t>(c.t.out[k]) % bytes == 0;
  }
  return ok;
}

template <auto Kernel>
cudaError_t launch(const FusedCall& c, cudaStream_t stream) {
  return launch_kernel<Kernel>(c.shape.blocks, c, stream);
}

template <typename T>
cudaError_t launch_grad_return(const FusedCall& c, bool wide, cudaStream_t stream) {
  return wide ? launch<fused_grad_return<T, uint4>>(c, stream)
              : launch<fused_grad_return<T, T>>(c, stream);
}

}  // namespace

FusedShape fused_shape(OpKind op, const CallPlan& plan, int32_t block_budget, int32_t push_blocks) {
  FusedShape s;
  const int64_t payload = plan.payload_bytes();
  s.tile_bytes =
      std::max(kMinTileBytes, ceil_div(ceil_div(payload, kMaxTiles), kTileAlign) * kTileAlign);
  s.tiles = std::max<int64_t>(1, ceil_div(payload, s.tile_bytes));
  const int64_t push_items = (plan.n - 1) * s.tiles;
  const int64_t finish_items = op == OpKind::kGradReturn ? s.tiles : s.tiles * plan.n;
  const bool every_block_both = push_blocks >= block_budget;
  s.push_blocks = static_cast<int32_t>(std::min<int64_t>(plan.n > 1 ? push_blocks : 0, push_items));
  const int64_t finishers = every_block_both ? block_budget : block_budget - s.push_blocks;
  s.finish_blocks = static_cast<int32_t>(std::clamp<int64_t>(finishers, 1, finish_items));
  s.blocks =
      every_block_both ? std::max(s.push_blocks, s.finish_blocks) : s.push_blocks + s.finish_blocks;
  if (ll_possible(plan)) {
    const int64_t units = ceil_div(payload, kLLUnitBytes);
    s.ll_blocks = static_cast<int32_t>(
        std::clamp<int64_t>(ceil_div(units, kFusedThreads), 1, std::max(block_budget, 1)));
  }
  return s;
}

cudaError_t launch_fused(OpKind op, const FusedCall& c, cudaStream_t stream) {
  // Decided by the plan alone, the same on every rank: a rank on tiles and one on LL words would
  // wait for signals the other never sends.
  if (c.shape.ll_blocks > 0) return launch_fused_ll(op, c, stream);
  const bool wide = all_aligned(c, 16);
  if (op == OpKind::kAllGather) {
    return wide ? launch<fused_all_gather<uint4>>(c, stream)
                : launch<fused_all_gather<uint16_t>>(c, stream);
  }
  switch (c.plan.dtype) {
    case ElementType::kF32:
      return launch_grad_return<float>(c, wide, stream);
    case ElementType::kBF16:
      return launch_grad_return<__nv_bfloat16>(c, wide, stream);
    case ElementType::kF16:
      return launch_grad_return<__half>(c, wide, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t load_kernels(std::initializer_list<const void*> kernels) {
  cudaFuncAttributes attr;
  for (const void* kernel : kernels) {
    if (cudaError_t err = cudaFuncGetAttributes(&attr, kernel); err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

cudaError_t warm_fused_kernels() {
  if (cudaError_t err = load_kernels(
          {reinterpret_cast<const void*>(fused_all_gather<uint4>),
           reinterpret_cast<const void*>(fused_all_gather<uint16_t>),
           reinterpret_cast<const void*>(fused_grad_return<float, uint4>),
           reinterpret_cast<const void*>(fused_grad_return<float, float>),
           reinterpret_cast<const void*>(fused_grad_return<__nv_bfloat16, uint4>),
           reinterpret_cast<const void*>(fused_grad_return<__nv_bfloat16, __nv_bfloat16>),
           reinterpret_cast<const void*>(fused_grad_return<__half, uint4>),
           reinterpret_cast<const void*>(fused_grad_return<__half, __half>)});
      err != cudaSuccess)
    return err;
  return warm_fused_ll_kernels();
}

}  // namespace jax_cpgrad
