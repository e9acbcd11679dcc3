// The push ceiling: every local GPU pushing the same bytes to each of its peers at once, by SM
// stores (one kernel, peers in the rotated order the transport uses) or by copy engines (one
// stream per peer). In a job of one process per GPU every process calls it after a barrier.
#include <cuda_runtime.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "bench/bench_bindings.h"
#include "bench/bench_util.h"
#include "call_plan.h"
#include "cuda_check.h"

namespace nb = nanobind;

namespace jax_cpgrad {
namespace {

constexpr int kThreads = 512;
constexpr int64_t kTileUnits = 4096;  // 64 KiB of uint4 per block and tile, as in the NVLink probe

struct Targets {
  uint4* dst[kMaxRanks];
};

// Blocks go target-major: with the targets already in rotated order, every writer starts on a
// different owner. Source p of a writer is its own bytes [p * units, (p + 1) * units).
__global__ void __launch_bounds__(kThreads)
    push_tiles(const uint4* src, Targets t, int64_t peers, int64_t units) {
  const int64_t tiles = (units + kTileUnits - 1) / kTileUnits;
  for (int64_t block = blockIdx.x; block < peers * tiles; block += gridDim.x) {
    const int64_t p = block / tiles;
    const int64_t end = std::min(units, (block % tiles + 1) * kTileUnits);
    for (int64_t i = block % tiles * kTileUnits + threadIdx.x; i < end; i += kThreads)
      t.dst[p][i] = src[p * units + i];
  }
}

struct Member {
  int device;
  std::vector<uintptr_t> targets;
  char* src = nullptr;
  cudaStream_t stream = nullptr;
  std::vector<cudaStream_t> peer_streams;  // copy engines: one per target
  cudaEvent_t start = nullptr, stop = nullptr;
  std::vector<cudaEvent_t> peer_done;
};

void enqueue_pushes(Member& m, int64_t bytes, int iters, bool copy_engines) {
  const int64_t peers = static_cast<int64_t>(m.targets.size());
  CPG_CUDA_OR_THROW(cudaEventRecord(m.start, m.stream));
  if (!copy_engines) {
    Targets t{};
    for (int64_t p = 0; p < peers; ++p) t.dst[p] = reinterpret_cast<uint4*>(m.targets[p]);
    const int64_t units = bytes / 16;
    const int64_t blocks =
        std::min<int64_t>(peers * ((units + kTileUnits - 1) / kTileUnits), 1 << 20);
    for (int i = 0; i < iters; ++i) {
      push_tiles<<<static_cast<unsigned>(blocks), kThreads, 0, m.stream>>>(
          reinterpret_cast<const uint4*>(m.src), t, peers, units);
    }
    CPG_CUDA_OR_THROW(cudaGetLastError());
  } else {
    for (int64_t p = 0; p < peers; ++p) {
      CPG_CUDA_OR_THROW(cudaStreamWaitEvent(m.peer_streams[p], m.start, 0));
      for (int i = 0; i < iters; ++i) {
        CPG_CUDA_OR_THROW(cudaMemcpyAsync(reinterpret_cast<void*>(m.targets[p]), m.src + p * bytes,
                                          bytes, cudaMemcpyDefault, m.peer_streams[p]));
      }
      CPG_CUDA_OR_THROW(cudaEventRecord(m.peer_done[p], m.peer_streams[p]));
      CPG_CUDA_OR_THROW(cudaStreamWaitEvent(m.stream, m.peer_done[p], 0));
    }
  }
  CPG_CUDA_OR_THROW(cudaEventRecord(m.stop, m.stream));
}

// members: (CUDA ordinal, [destination pointer per peer, rotated order]) of every local GPU.
// Returns milliseconds per push (of `bytes` to every peer) over `reps` repetitions of `iters`
// pushes: the slowest local GPU of each repetition.
nb::dict push_bandwidth(const std::vector<std::tuple<int, std::vector<uintptr_t>>>& members,
                        int64_t bytes, int iters, int reps, const std::string& engine) {
  if (engine != "sm" && engine != "ce") throw std::invalid_argument("engine must be 'sm' or 'ce'");
  if (bytes < 16 || bytes % 16 != 0)
    throw std::invalid_argument("bytes must be a positive multiple of 16");
  const bool copy_engines = engine == "ce";
  std::vector<Member> ms;
  for (const auto& [device, targets] : members) {
    ms.emplace_back();
    ms.back().device = device;
    ms.back().targets = targets;
  }
  auto release = [&] {
    for (Member& m : ms) {
      cudaSetDevice(m.device);
      if (m.stream) cudaStreamSynchronize(m.stream);
      for (cudaStream_t s : m.peer_streams) cudaStreamDestroy(s);
      for (cudaEvent_t e : m.peer_done) cudaEventDestroy(e);
      if (m.start) cudaEventDestroy(m.start);
      if (m.stop) cudaEventDestroy(m.stop);
      if (m.stream) cudaStreamDestroy(m.stream);
      if (m.src) cudaFree(m.src);
    }
  };
  std::vector<float> per_push;
  try {
    for (Member& m : ms) {
      DeviceGuard guard(m.device);
      CPG_CUDA_OR_THROW(cudaMalloc(&m.src, bytes * std::max<size_t>(1, m.targets.size())));
      CPG_CUDA_OR_THROW(cudaMemset(m.src, 1, bytes * std::max<size_t>(1, m.targets.size())));
      CPG_CUDA_OR_THROW(cudaStreamCreateWithFlags(&m.stream, cudaStreamNonBlocking));
      CPG_CUDA_OR_THROW(cudaEventCreate(&m.start));
      CPG_CUDA_OR_THROW(cudaEventCreate(&m.stop));
      for (size_t p = 0; p < m.targets.size(); ++p) {
        m.peer_streams.emplace_back();
        m.peer_done.emplace_back();
        CPG_CUDA_OR_THROW(cudaStreamCreateWithFlags(&m.peer_streams.back(), cudaStreamNonBlocking));
        CPG_CUDA_OR_THROW(cudaEventCreate(&m.peer_done.back()));
      }
      CPG_CUDA_OR_THROW(cudaDeviceSynchronize());
    }
    for (int r = -1; r < reps; ++r) {  // r = -1: warm-up
      for (Member& m : ms) {
        DeviceGuard guard(m.device);
        enqueue_pushes(m, bytes, iters, copy_engines);
      }
      const float slowest = slowest_elapsed_ms(ms);
      if (r >= 0) per_push.push_back(slowest / iters);
    }
  } catch (...) {
    release();
    throw;
  }
  release();
  std::sort(per_push.begin(), per_push.end());
  nb::dict d;
  d["median_ms"] = per_push.empty() ? 0.0f : per_push[per_push.size() / 2];
  d["min_ms"] = per_push.empty() ? 0.0f : per_push.front();
  d["max_ms"] = per_push.empty() ? 0.0f : per_push.back();
  d["engine"] = engine;
  return d;
}

}  // namespace

void bind_push_bench(nb::module_& m) {
  m.def("push_bandwidth", &push_bandwidth, nb::arg("members"), nb::arg("bytes_per_peer"),
        nb::arg("iters") = 10, nb::arg("reps") = 5, nb::arg("engine") = "sm",
        "Milliseconds per push of bytes_per_peer to every target, all local GPUs at once.");
}

}  // namespace jax_cpgrad
