// The device protocol's per-call latency on real GPUs, without XLA: one process, every local GPU a
// rank (peer access), `calls` fused calls back to back on each, recorded into one CUDA graph per
// GPU (as XLA's command buffers do) or launched one by one. Beside it the same chain of an empty
// kernel that takes the same argument block: what launching alone costs. The difference between
// this and benchmarks/grad_return.py's straight-line figure is what XLA adds around each call.
#include <cuda_runtime.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench/bench_bindings.h"
#include "bench/bench_util.h"
#include "cuda_check.h"
#include "fused_kernels.h"

namespace nb = nanobind;

namespace jax_cpgrad {
namespace {

// Reads one word of its argument block so that the block is really passed.
__global__ void empty_call(FusedCall c) {
  if (c.timeout_ns == 1) c.report->timed_out = 1;
}

struct Rank {
  int device = 0;
  std::unique_ptr<DeviceBuffer> header, slots;
  std::vector<std::unique_ptr<DeviceBuffer>> in, out;
  HostReport* report = nullptr;  // mapped pinned host memory
  HostReport* report_on_device = nullptr;
  cudaStream_t stream = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr;
  cudaGraphExec_t graph = nullptr;
  FusedCall call{};
};

void enable_peer_access(int device, const std::vector<int>& devices) {
  DeviceGuard guard(device);
  for (int other : devices) {
    if (other == device) continue;
    cudaError_t err = cudaDeviceEnablePeerAccess(other, 0);
    if (err == cudaErrorPeerAccessAlreadyEnabled)
      cudaGetLastError();
    else
      CPG_CUDA_OR_THROW(err);
  }
}

// shape_override: {tile_bytes, blocks, push_blocks, finish_blocks}, or empty for fused_shape's.
FusedShape chain_shape(OpKind op, const CallPlan& plan, int32_t block_budget, int32_t push_blocks,
                       const std::vector<int64_t>& shape_override) {
  if (shape_override.empty()) return fused_shape(op, plan, block_budget, push_blocks);
  if (shape_override.size() != 4) throw std::invalid_argument("shape: 4 numbers");
  FusedShape s;
  s.tile_bytes = shape_override[0];
  if (s.tile_bytes <= 0 || s.tile_bytes % 16 != 0)
    throw std::invalid_argument("shape: tile_bytes must be a positive multiple of 16");
  s.tiles = (plan.payload_bytes() + s.tile_bytes - 1) / s.tile_bytes;
  if (s.tiles > kMaxTiles) throw std::invalid_argument("shape: more tiles than kMaxTiles");
  s.blocks = static_cast<int32_t>(shape_override[1]);
  s.push_blocks = static_cast<int32_t>(shape_override[2]);
  s.finish_blocks = static_cast<int32_t>(shape_override[3]);
  // The kernel's contract (fused_kernels.h): pushing and finishing blocks are disjoint, or every
  // block does both; someone pushes when there are peers, someone finishes.
  const bool disjoint = s.push_blocks + s.finish_blocks == s.blocks;
  const bool both = s.push_blocks == s.blocks && s.finish_blocks == s.blocks;
  if (s.finish_blocks < 1 || (plan.n > 1 && s.push_blocks < 1) || !(disjoint || both))
    throw std::invalid_argument("shape: blocks must be push + finish, or all of them doing both");
  return s;
}

cudaError_t enqueue(const Rank& r, OpKind op, bool empty) {
  if (!empty) return launch_fused(op, r.call, r.stream);
  const FusedShape& s = r.call.shape;
  const int32_t blocks = s.ll_blocks > 0 ? s.ll_blocks : s.blocks;
  empty_call<<<blocks, kFusedThreads, 0, r.stream>>>(r.call);
  return cudaGetLastError();
}

nb::dict chain_bench(const std::vector<int>& devices, const std::string& op_name,
                     int64_t global_bytes, int calls, int reps, int32_t block_budget,
                     int32_t push_blocks, const std::string& kernel, bool graph,
                     const std::vector<int64_t>& shape_override, const std::string& wire) {
  if (wire != "auto" && wire != "tiles") throw std::invalid_argument("wire: 'auto' or 'tiles'");
  if (kernel != "fused" && kernel != "empty")
    throw std::invalid_argument("kernel: 'fused' or 'empty'");
  if (op_name != "grad_return" && op_name != "all_gather")
    throw std::invalid_argument("op: 'grad_return' or 'all_gather'");
  if (devices.empty() || calls < 1 || reps < 1)
    throw std::invalid_argument("devices, calls and reps must not be empty or zero");
  const OpKind op = op_name == "grad_return" ? OpKind::kGradReturn : OpKind::kAllGather;
  const bool empty = kernel == "empty";
  const int64_t n = static_cast<int64_t>(devices.size());
  const CallPlan plan = bf16_pair_plan(n, global_bytes, 8);
  const int64_t global = plan.tensor_bytes() * n;
  const int64_t in_bytes = op == OpKind::kGradReturn ? global : plan.tensor_bytes();
  const int64_t out_bytes = op == OpKind::kGradReturn ? plan.tensor_bytes() : global;

  std::vector<Rank> ranks(n);
  auto release = [&] {
    for (Rank& r : ranks) {
      cudaSetDevice(r.device);
      if (r.stream) cudaStreamSynchronize(r.stream);
      if (r.graph) cudaGraphExecDestroy(r.graph);
      if (r.start) cudaEventDestroy(r.start);
      if (r.stop) cudaEventDestroy(r.stop);
      if (r.stream) cudaStreamDestroy(r.stream);
      if (r.report) cudaFreeHost(r.report);
      r.header.reset();
      r.slots.reset();
      r.in.clear();
      r.out.clear();
    }
  };
  std::vector<float> per_call_us;  // the slowest rank of each repetition
  nb::dict result;
  try {
    for (int64_t i = 0; i < n; ++i) {
      Rank& r = ranks[i];
      r.device = devices[i];
      enable_peer_access(r.device, devices);
      DeviceGuard guard(r.device);
      r.header = std::make_unique<DeviceBuffer>(header_bytes(n, plan.slot_bytes));
      CPG_CUDA_OR_THROW(cudaMemset(r.header->ptr, 0, header_bytes(n, plan.slot_bytes)));
      r.slots = std::make_unique<DeviceBuffer>(slots_bytes(n, plan.slot_bytes));
      for (int k = 0; k < plan.tensors; ++k) {
        r.in.push_back(std::make_unique<DeviceBuffer>(in_bytes));
        CPG_CUDA_OR_THROW(cudaMemset(r.in.back()->ptr, 0, in_bytes));
        r.out.push_back(std::make_unique<DeviceBuffer>(out_bytes));
      }
      CPG_CUDA_OR_THROW(cudaHostAlloc(reinterpret_cast<void**>(&r.report), sizeof(HostReport),
                                      cudaHostAllocMapped));
      *r.report = HostReport{};
      CPG_CUDA_OR_THROW(
          cudaHostGetDevicePointer(reinterpret_cast<void**>(&r.report_on_device), r.report, 0));
      CPG_CUDA_OR_THROW(cudaStreamCreateWithFlags(&r.stream, cudaStreamNonBlocking));
      CPG_CUDA_OR_THROW(cudaEventCreate(&r.start));
      CPG_CUDA_OR_THROW(cudaEventCreate(&r.stop));
      CPG_CUDA_OR_THROW(cudaDeviceSynchronize());
    }
    for (int64_t i = 0; i < n; ++i) {
      FusedCall& c = ranks[i].call;
      c.plan = plan;
      c.plan.self = i;
      for (int64_t j = 0; j < n; ++j) {
        c.peers.header[j] = ranks[j].header->ptr;
        c.peers.slots[j] = ranks[j].slots->ptr;
      }
      for (int k = 0; k < plan.tensors; ++k) {
        c.t.in[k] = ranks[i].in[k]->ptr;
        c.t.out[k] = ranks[i].out[k]->ptr;
      }
      c.report = ranks[i].report_on_device;
      c.shape = chain_shape(op, c.plan, block_budget, push_blocks, shape_override);
      if (wire == "tiles") c.shape.ll_blocks = 0;
      c.timeout_ns = 10'000'000'000ull;  // a protocol bug fails the call instead of hanging
    }
    if (graph) {
      for (Rank& r : ranks) {
        DeviceGuard guard(r.device);
        cudaGraph_t g = nullptr;
        CPG_CUDA_OR_THROW(cudaStreamBeginCapture(r.stream, cudaStreamCaptureModeThreadLocal));
        cudaError_t err = cudaSuccess;
        for (int c = 0; c < calls && err == cudaSuccess; ++c) err = enqueue(r, op, empty);
        const cudaError_t end = cudaStreamEndCapture(r.stream, &g);  // always leave capture mode
        if (err == cudaSuccess && end == cudaSuccess) err = cudaGraphInstantiate(&r.graph, g, 0);
        if (g != nullptr) cudaGraphDestroy(g);
        CPG_CUDA_OR_THROW(err != cudaSuccess ? err : end);
      }
    }
    for (int rep = -1; rep < reps; ++rep) {  // rep -1: warm-up
      for (Rank& r : ranks) {
        DeviceGuard guard(r.device);
        CPG_CUDA_OR_THROW(cudaEventRecord(r.start, r.stream));
        if (graph) CPG_CUDA_OR_THROW(cudaGraphLaunch(r.graph, r.stream));
      }
      if (!graph) {
        for (int c = 0; c < calls; ++c) {
          for (Rank& r : ranks) {
            CPG_CUDA_OR_THROW(cudaSetDevice(r.device));
            CPG_CUDA_OR_THROW(enqueue(r, op, empty));
          }
        }
      }
      for (Rank& r : ranks) {
        DeviceGuard guard(r.device);
        CPG_CUDA_OR_THROW(cudaEventRecord(r.stop, r.stream));
      }
      const float slowest = slowest_elapsed_ms(ranks);
      for (const Rank& r : ranks) {
        if (r.report->timed_out) throw std::runtime_error("a fused call timed out");
      }
      if (rep >= 0) per_call_us.push_back(1e3f * slowest / calls);
    }
    const FusedShape& s = ranks[0].call.shape;
    result["shape"] = std::vector<int64_t>{s.tile_bytes,  s.tiles,         s.blocks,
                                           s.push_blocks, s.finish_blocks, s.ll_blocks};
  } catch (...) {
    release();
    throw;
  }
  release();
  std::sort(per_call_us.begin(), per_call_us.end());
  result["us_per_call"] = per_call_us[per_call_us.size() / 2];
  result["min_us"] = per_call_us.front();
  result["max_us"] = per_call_us.back();
  result["payload_bytes"] = plan.payload_bytes();
  return result;
}

}  // namespace

namespace {

// The device protocol's launch shape for one call, as the handler computes it (no GPU needed):
// what tests check the choice between LL words and tiles against.
nb::dict launch_shape(const std::string& op_name, int64_t n, int64_t tensors, int64_t outer,
                      int64_t run, int64_t element_bytes, int32_t block_budget,
                      int32_t push_blocks) {
  if (op_name != "grad_return" && op_name != "all_gather")
    throw std::invalid_argument("op: 'grad_return' or 'all_gather'");
  if (element_bytes != 2 && element_bytes != 4)
    throw std::invalid_argument("element_bytes: 2 or 4");
  CallPlan plan;
  plan.n = n;
  plan.tensors = tensors;
  plan.outer = outer;
  plan.run = run;
  plan.dtype = element_bytes == 4 ? ElementType::kF32 : ElementType::kBF16;
  plan.slot_bytes = round_up_slot_bytes(plan.payload_bytes());
  const OpKind op = op_name == "grad_return" ? OpKind::kGradReturn : OpKind::kAllGather;
  const FusedShape s = fused_shape(op, plan, block_budget, push_blocks);
  nb::dict d;
  d["payload_bytes"] = plan.payload_bytes();
  d["tile_bytes"] = s.tile_bytes;
  d["tiles"] = s.tiles;
  d["blocks"] = s.blocks;
  d["push_blocks"] = s.push_blocks;
  d["finish_blocks"] = s.finish_blocks;
  d["ll_blocks"] = s.ll_blocks;
  return d;
}

}  // namespace

void bind_chain_bench(nb::module_& m) {
  m.def("launch_shape", &launch_shape, nb::arg("op"), nb::arg("n"), nb::arg("tensors"),
        nb::arg("outer"), nb::arg("run"), nb::arg("element_bytes"), nb::arg("block_budget") = 132,
        nb::arg("push_blocks") = 66,
        "The device protocol's launch shape for one call (ll_blocks > 0: LL words).");
  m.def("chain_bench", &chain_bench, nb::arg("devices"), nb::arg("op") = "grad_return",
        nb::arg("global_bytes") = 65536, nb::arg("calls") = 200, nb::arg("reps") = 7,
        nb::arg("block_budget") = 132, nb::arg("push_blocks") = 66, nb::arg("kernel") = "fused",
        nb::arg("graph") = true, nb::arg("shape") = std::vector<int64_t>{},
        nb::arg("wire") = "auto",
        "Microseconds per device-protocol call (bf16, 2 tensors) chained on every listed GPU "
        "without XLA; shape = [tile_bytes, blocks, push_blocks, finish_blocks] overrides the "
        "tile launch shape; wire = 'tiles' keeps small calls off the LL words.");
}

}  // namespace jax_cpgrad
