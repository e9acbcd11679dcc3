// Single-GPU measurements of the transport's kernels: R writers are emulated by R regions on one
// device, so they measure HBM efficiency and per-call cost, not NVLink.
#include <cuda_runtime.h>
#include <nanobind/stl/string.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "bench/bench_bindings.h"
#include "bench/bench_util.h"
#include "cuda_check.h"
#include "fused_kernels.h"
#include "memop_kernels.h"
#include "stream_protocol.h"

namespace nb = nanobind;

namespace jax_cpgrad {
namespace {

// R ranks' headers and slots, all on this GPU, the flags at `flag_epoch` and the state ok.
struct EmulatedPeers {
  EmulatedPeers(int64_t n, int64_t slot_bytes, uint32_t flag_epoch) {
    std::vector<uint32_t> header(header_bytes(n, slot_bytes) / 4, flag_epoch);
    std::fill(header.begin(), header.begin() + kControlBytes / 4, 0u);
    for (int64_t r = 0; r < n; ++r) {
      headers.push_back(std::make_unique<RegionBuffer>(header_bytes(n, slot_bytes)));
      slots.push_back(std::make_unique<RegionBuffer>(slots_bytes(n, slot_bytes)));
      CPG_CUDA_OR_THROW(cudaMemcpy(headers.back()->ptr, header.data(), header_bytes(n, slot_bytes),
                                   cudaMemcpyHostToDevice));
      CPG_CUDA_OR_THROW(cudaMemset(slots.back()->ptr, 0, slots_bytes(n, slot_bytes)));
      table.header[r] = headers.back()->ptr;
      table.slots[r] = slots.back()->ptr;
    }
  }
  std::vector<std::unique_ptr<RegionBuffer>> headers, slots;
  PeerTable table{};
};

// Median, min and max milliseconds per launch of `fn` over `reps` timed groups of `iters`.
nb::dict time_ms(const std::function<cudaError_t(cudaStream_t)>& fn, cudaStream_t stream, int iters,
                 int reps) {
  for (int i = 0; i < 3; ++i) CPG_CUDA_OR_THROW(fn(stream));
  cudaEvent_t start, stop;
  CPG_CUDA_OR_THROW(cudaEventCreate(&start));
  CPG_CUDA_OR_THROW(cudaEventCreate(&stop));
  std::vector<float> per_launch;
  for (int r = 0; r < reps; ++r) {
    CPG_CUDA_OR_THROW(cudaEventRecord(start, stream));
    for (int i = 0; i < iters; ++i) CPG_CUDA_OR_THROW(fn(stream));
    CPG_CUDA_OR_THROW(cudaEventRecord(stop, stream));
    CPG_CUDA_OR_THROW(cudaEventSynchronize(stop));
    float ms = 0;
    CPG_CUDA_OR_THROW(cudaEventElapsedTime(&ms, start, stop));
    per_launch.push_back(ms / iters);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(per_launch.begin(), per_launch.end());
  nb::dict d;
  d["median_ms"] = per_launch[per_launch.size() / 2];
  d["min_ms"] = per_launch.front();
  d["max_ms"] = per_launch.back();
  return d;
}

ElementType parse_dtype(const std::string& name) {
  if (name == "float32") return ElementType::kF32;
  if (name == "bfloat16") return ElementType::kBF16;
  if (name == "float16") return ElementType::kF16;
  throw std::invalid_argument("dtype must be float32, bfloat16 or float16");
}

// Times scatter, accumulate, gather and plain copies for one rank of an R-way call moving
// `tensors` tensors of `global_bytes` each (shape [S, inner], sequence axis 0).
nb::dict kernel_bench(int64_t n, int64_t tensors, int64_t global_bytes, const std::string& dtype,
                      int iters, int reps) {
  CallPlan plan;
  plan.n = n;
  plan.self = 0;
  plan.tensors = tensors;
  plan.dtype = parse_dtype(dtype);
  plan.outer = 1;
  plan.run = global_bytes / element_bytes(plan.dtype) / (2 * n);
  if (plan.run < 1 || tensors < 1 || tensors > kMaxTensors || n < 1 || n > kMaxRanks) {
    throw std::invalid_argument("size too small for this N, or bad N / tensor count");
  }
  const int64_t local_bytes = plan.tensor_bytes();
  const int64_t global = local_bytes * n;
  plan.slot_bytes = round_up_slot_bytes(tensors * local_bytes);

  EmulatedPeers peers(n, plan.slot_bytes, 0);
  const PeerTable& table = peers.table;
  std::vector<std::unique_ptr<DeviceBuffer>> inputs, outputs, locals, gathered;
  std::vector<const void*> in, local_in;
  std::vector<void*> out, gather_out;
  for (int64_t k = 0; k < tensors; ++k) {
    inputs.push_back(std::make_unique<DeviceBuffer>(global));
    outputs.push_back(std::make_unique<DeviceBuffer>(local_bytes));
    locals.push_back(std::make_unique<DeviceBuffer>(local_bytes));
    gathered.push_back(std::make_unique<DeviceBuffer>(global));
    CPG_CUDA_OR_THROW(cudaMemset(inputs.back()->ptr, 0, global));
    CPG_CUDA_OR_THROW(cudaMemset(locals.back()->ptr, 0, local_bytes));
    in.push_back(inputs.back()->ptr);
    local_in.push_back(locals.back()->ptr);
    out.push_back(outputs.back()->ptr);
    gather_out.push_back(gathered.back()->ptr);
  }
  const int64_t moved = (n - 1) * tensors * local_bytes;  // bytes each rank sends
  DeviceBuffer copy_src(std::max(moved, (n + 1) * tensors * local_bytes));
  DeviceBuffer copy_dst(std::max(moved, (n + 1) * tensors * local_bytes));
  cudaStream_t stream;
  CPG_CUDA_OR_THROW(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  nb::dict result;
  result["n"] = n;
  result["tensors"] = tensors;
  result["dtype"] = dtype;
  result["global_bytes_per_tensor"] = global;
  result["local_bytes_per_tensor"] = local_bytes;
  // Memory traffic (bytes read + written) of each step, and of a plain copy of the same size.
  result["scatter_traffic"] = 2 * moved;
  result["accumulate_traffic"] = (n + 1) * tensors * local_bytes;
  result["gather_traffic"] = 2 * n * tensors * local_bytes;
  result["scatter"] = time_ms(
      [&](cudaStream_t s) { return launch_scatter_owner_chunks(plan, in.data(), table, s); },
      stream, iters, reps);
  result["accumulate"] = time_ms(
      [&](cudaStream_t s) { return launch_accumulate(plan, in.data(), out.data(), table, s); },
      stream, iters, reps);
  result["gather"] = time_ms(
      [&](cudaStream_t s) {
        return launch_gather(plan, local_in.data(), gather_out.data(), table, s);
      },
      stream, iters, reps);
  const int64_t acc_copy = (n + 1) * tensors * local_bytes / 2;
  const int64_t gather_copy = n * tensors * local_bytes;
  result["copy_scatter_size"] = time_ms(
      [&](cudaStream_t s) {
        return cudaMemcpyAsync(copy_dst.ptr, copy_src.ptr, moved, cudaMemcpyDeviceToDevice, s);
      },
      stream, iters, reps);
  result["copy_accumulate_size"] = time_ms(
      [&](cudaStream_t s) {
        return cudaMemcpyAsync(copy_dst.ptr, copy_src.ptr, acc_copy, cudaMemcpyDeviceToDevice, s);
      },
      stream, iters, reps);
  result["copy_gather_size"] = time_ms(
      [&](cudaStream_t s) {
        return cudaMemcpyAsync(copy_dst.ptr, copy_src.ptr, gather_copy, cudaMemcpyDeviceToDevice,
                               s);
      },
      stream, iters, reps);
  cudaStreamDestroy(stream);
  return result;
}

// Plain copy of `bytes` from GPU `src` to GPU `dst` (the same GPU: a device copy; another: a
// peer copy over NVLink/PCIe): the ceiling for the bytes a rank sends.
nb::dict copy_bench(int src, int dst, int64_t bytes, int iters, int reps) {
  int previous = 0;
  cudaGetDevice(&previous);
  CPG_CUDA_OR_THROW(cudaSetDevice(dst));
  DeviceBuffer to(bytes);
  CPG_CUDA_OR_THROW(cudaSetDevice(src));
  DeviceBuffer from(bytes);
  if (src != dst) {
    cudaError_t err = cudaDeviceEnablePeerAccess(dst, 0);
    if (err == cudaErrorPeerAccessAlreadyEnabled)
      cudaGetLastError();
    else
      CPG_CUDA_OR_THROW(err);
  }
  cudaStream_t stream;
  CPG_CUDA_OR_THROW(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  nb::dict d = time_ms(
      [&](cudaStream_t s) { return cudaMemcpyPeerAsync(to.ptr, dst, from.ptr, src, bytes, s); },
      stream, iters, reps);
  cudaStreamDestroy(stream);
  cudaSetDevice(previous);
  return d;
}

// Fixed cost of one call for one rank, R writers emulated on this GPU with every wait already
// satisfied: host time to enqueue, and GPU time per call, for the whole call and its parts.
nb::dict call_overhead_bench(int64_t n, int64_t global_bytes, int iters, int32_t block_budget,
                             int32_t push_blocks) {
  const CallPlan plan = bf16_pair_plan(n, global_bytes, 1);
  // Our own flags already hold a later epoch than any call here reaches: every wait passes at once.
  EmulatedPeers peers(n, plan.slot_bytes, 1u << 30);
  const PeerTable& table = peers.table;
  std::vector<std::unique_ptr<DeviceBuffer>> bufs;
  const void* in[2];
  void* out[2];
  for (int k = 0; k < 2; ++k) {
    bufs.push_back(std::make_unique<DeviceBuffer>(plan.tensor_bytes() * n));
    in[k] = bufs.back()->ptr;
    bufs.push_back(std::make_unique<DeviceBuffer>(plan.tensor_bytes()));
    out[k] = bufs.back()->ptr;
  }
  HostReport* report = nullptr;
  CPG_CUDA_OR_THROW(
      cudaHostAlloc(reinterpret_cast<void**>(&report), sizeof(HostReport), cudaHostAllocMapped));
  void* report_dev = nullptr;
  CPG_CUDA_OR_THROW(cudaHostGetDevicePointer(&report_dev, report, 0));
  HostReport* report_on_device = static_cast<HostReport*>(report_dev);
  const ProtocolSite site{n, 0, &table, &report_on_device->reached, &report_on_device->passed};
  FusedCall fused{};
  fused.plan = plan;
  fused.peers = table;
  fused.report = report_on_device;
  fused.shape = fused_shape(OpKind::kGradReturn, plan, block_budget, push_blocks);
  fused.shape.ll_blocks = 0;  // the emulated peers' flags say "arrived"; no one writes LL words
  for (int k = 0; k < 2; ++k) {
    fused.t.in[k] = static_cast<const char*>(in[k]);
    fused.t.out[k] = static_cast<char*>(out[k]);
  }
  cudaStream_t stream;
  CPG_CUDA_OR_THROW(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  uint32_t epoch = 0;
  auto scatter = [&] { return launch_scatter_owner_chunks(plan, in, table, stream); };
  auto memops = [&] {
    return enqueue_publish_and_wait(site, ++epoch, stream) == CUDA_SUCCESS ? cudaSuccess
                                                                           : cudaErrorUnknown;
  };
  auto accumulate = [&] { return launch_accumulate(plan, in, out, table, stream); };
  auto fused_call = [&] { return launch_fused(OpKind::kGradReturn, fused, stream); };
  auto measure = [&](const std::function<cudaError_t()>& fn) {
    for (int i = 0; i < 5; ++i) CPG_CUDA_OR_THROW(fn());
    CPG_CUDA_OR_THROW(cudaStreamSynchronize(stream));
    cudaEvent_t start, stop;
    CPG_CUDA_OR_THROW(cudaEventCreate(&start));
    CPG_CUDA_OR_THROW(cudaEventCreate(&stop));
    CPG_CUDA_OR_THROW(cudaEventRecord(start, stream));
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < iters; ++i) CPG_CUDA_OR_THROW(fn());
    const auto t1 = std::chrono::steady_clock::now();
    CPG_CUDA_OR_THROW(cudaEventRecord(stop, stream));
    CPG_CUDA_OR_THROW(cudaEventSynchronize(stop));
    float ms = 0;
    CPG_CUDA_OR_THROW(cudaEventElapsedTime(&ms, start, stop));
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    nb::dict d;
    d["host_us"] = std::chrono::duration<double, std::micro>(t1 - t0).count() / iters;
    d["gpu_us"] = 1e3 * ms / iters;
    return d;
  };
  nb::dict result;
  result["n"] = n;
  result["global_bytes_per_tensor"] = plan.tensor_bytes() * n;
  result["stream_mem_ops_per_call"] = n > 1 ? 2 * (n - 1) + 2 : 0;
  result["api_calls_per_call"] =
      n > 1 ? 3 : 2;  // scatter launch, one batch of memory ops, accumulate launch
  result["call"] = measure([&] {
    cudaError_t err = scatter();
    if (err == cudaSuccess && n > 1) err = memops();
    return err == cudaSuccess ? accumulate() : err;
  });
  result["scatter_launch"] = measure(scatter);
  result["accumulate_launch"] = measure(accumulate);
  if (n > 1) result["publish_and_wait"] = measure(memops);
  result["fused_call"] = measure(fused_call);
  result["fused_blocks"] = fused.shape.blocks;
  cudaStreamDestroy(stream);
  cudaFreeHost(report);
  return result;
}

}  // namespace

void bind_kernel_bench(nb::module_& m) {
  m.def("kernel_bench", &kernel_bench, nb::arg("n"), nb::arg("tensors"), nb::arg("global_bytes"),
        nb::arg("dtype"), nb::arg("iters") = 20, nb::arg("reps") = 7,
        "Time the transport's kernels for one rank, N writers emulated on this GPU.");
  m.def("call_overhead_bench", &call_overhead_bench, nb::arg("n"), nb::arg("global_bytes") = 4096,
        nb::arg("iters") = 2000, nb::arg("block_budget") = 64, nb::arg("push_blocks") = 32,
        "Fixed per-call cost for one rank (host enqueue and GPU time), both protocols.");
  m.def("copy_bench", &copy_bench, nb::arg("src"), nb::arg("dst"), nb::arg("bytes"),
        nb::arg("iters") = 20, nb::arg("reps") = 7,
        "Time a plain copy of `bytes` from GPU src to GPU dst.");
}

}  // namespace jax_cpgrad
