// The handlers: instantiate binds the executable to its workspace; execute checks the call
// (call_check.h) and enqueues one protocol. Nothing here blocks the host, allocates, or changes
// peer access: all of that happened when the workspace was created.
#include "handlers.h"

#include <cuda_runtime.h>

#include <memory>
#include <string>

#include "call_check.h"
#include "fused_kernels.h"
#include "memop_kernels.h"
#include "stream_protocol.h"
#include "watchdog.h"
#include "workspace_state.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_cpgrad {
namespace {

// What an executable keeps for each of its calls: the workspace, alive as long as the executable
// (so a CUDA graph recorded from it never points at freed headers; see region_layout.h).
struct CallState {
  static ffi::TypeId id;
  std::shared_ptr<WorkspaceState> ws;
};
ffi::TypeId CallState::id = {};
const XLA_FFI_TypeInfo kCallStateTypeInfo = {
    XLA_FFI_TypeInfo_STRUCT_SIZE, nullptr,
    [](void* state) { delete static_cast<CallState*>(state); }};

ffi::ErrorOr<std::unique_ptr<CallState>> Instantiate(CallAttrs attrs) {
  std::shared_ptr<WorkspaceState> ws = Registry::get().find(attrs.workspace_id);
  if (ws == nullptr) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "jax_cpgrad: workspace #" + std::to_string(attrs.workspace_id) +
                          " is closed (or was never created in this process)");
  }
  return std::make_unique<CallState>(CallState{std::move(ws)});
}

ffi::Error launch_error(cudaError_t err, const char* what) {
  return ffi::Error::Internal(std::string("jax_cpgrad: launching ") + what + " failed: " +
                              cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")");
}

// A call's buffers as its start records them and its done checks them. Empty arrays have no
// buffer to keep (XLA may hand the done a constant for them): they are recorded as null.
CallBuffers call_buffers(const TensorPtrs& t, int64_t count, bool empty) {
  CallBuffers b;
  b.count = count;
  for (int64_t k = 0; k < count && !empty; ++k) {
    b.results[k] = t.out[k];
    b.inputs[k] = t.in[k];
  }
  return b;
}

// The memop protocol: scatter, one batch of stream memory ops, accumulate or gather. The
// epoch is the host's: the next one of this device.
template <OpKind kOp>
ffi::Error enqueue_stream_memops(const WorkspaceState& ws, Member& m, CallPlan plan,
                                 const TensorPtrs& t, cudaStream_t stream) {
  const uint32_t e = m.epoch.load(std::memory_order_relaxed) + 1;
  m.epoch.store(e, std::memory_order_relaxed);
  m.op_of_epoch[e % m.op_of_epoch.size()].store(static_cast<uint8_t>(kOp),
                                                std::memory_order_relaxed);
  plan.set = ws.single_buffer.load() ? 0 : e & 1;
  const PeerTable& peers = m.region.peers();
  const void* const* in = reinterpret_cast<const void* const*>(t.in);
  void* const* out = reinterpret_cast<void* const*>(t.out);
  cudaError_t err = kOp == OpKind::kGradReturn
                        ? launch_scatter_owner_chunks(plan, in, peers, stream)
                        : launch_scatter_local_copies(plan, in, peers, stream);
  if (err != cudaSuccess) return launch_error(err, "the scatter");
  if (plan.n > 1) {
    HostReport* report = m.region.report_on_device();
    const ProtocolSite site{plan.n, plan.self, &peers, &report->reached, &report->passed};
    if (CUresult res = enqueue_publish_and_wait(site, e, stream); res != CUDA_SUCCESS) {
      return ffi::Error::Internal("jax_cpgrad: cuStreamBatchMemOp failed with CUresult " +
                                  std::to_string(static_cast<int>(res)));
    }
  }
  err = kOp == OpKind::kGradReturn ? launch_accumulate(plan, in, out, peers, stream)
                                   : launch_gather(plan, in, out, peers, stream);
  return err == cudaSuccess
             ? ffi::Error::Success()
             : launch_error(err, kOp == OpKind::kGradReturn ? "the accumulation" : "the gather");
}

// The device protocol: one kernel, the same arguments every call (see fused_kernels.h).
template <OpKind kOp>
ffi::Error enqueue_fused(const WorkspaceState& ws, const Member& m, const CallPlan& plan,
                         const TensorPtrs& t, cudaStream_t stream) {
  if (plan.payload_bytes() == 0)
    return ffi::Error::Success();  // the same on every rank: no epoch is used
  const WorkspaceConfig& cfg = ws.config;
  FusedCall call{};
  call.plan = plan;
  call.t = t;
  call.peers = m.region.peers();
  call.report = m.region.report_on_device();
  call.shape = fused_shape(kOp, plan, cfg.block_budget, cfg.push_blocks);
  call.timeout_ns = static_cast<uint64_t>(cfg.timeout_s * 1e9);
  call.single_buffer = ws.single_buffer.load();
  cudaError_t err = launch_fused(kOp, call, stream);
  return err == cudaSuccess ? ffi::Error::Success()
                            : launch_error(err, "the device protocol's kernel");
}

// How a call reaches the GPU: whole on XLA's stream, or (Workspace(overlap=True)) as the start of
// a start/done pair, enqueued on the workspace's own stream (call_stream.h).
enum class Phase : uint8_t { kWhole, kStart };

template <OpKind kOp, Protocol kProtocol, Phase kPhase>
ffi::Error Execute(cudaStream_t stream, int32_t device, CallState* state, ffi::RemainingArgs args,
                   ffi::RemainingRets rets, CallAttrs attrs) {
  WorkspaceState& ws = *state->ws;
  std::shared_lock lock(ws.mu);  // close() waits until this call is enqueued
  if (ws.closed) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "jax_cpgrad: workspace '" + ws.config.name + "' is closed");
  }
  if (kProtocol == Protocol::kDevice ? sync_device_failure(ws) : ws.failed.load()) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition, ws.failure_text());
  }
  if (ws.config.protocol != kProtocol) {
    return ffi::Error::InvalidArgument(std::string("jax_cpgrad: workspace '") + ws.config.name +
                                       "' runs the " + protocol_name(ws.config.protocol) +
                                       " protocol, not the " + protocol_name(kProtocol) + " one");
  }
  // One stream per workspace and GPU keeps its calls one at a time and in order: an overlapped
  // workspace takes only starts, any other only whole calls.
  if (ws.config.overlap != (kPhase == Phase::kStart)) {
    return ffi::Error::InvalidArgument(
        std::string("jax_cpgrad: workspace '") + ws.config.name +
        (ws.config.overlap ? "' runs its calls on its own stream (overlap=True): got a whole call"
                           : "' was created without overlap=True: got the start of a pair"));
  }
  Member* m = ws.member_for_device(device);
  if (m == nullptr) {
    return ffi::Error::InvalidArgument("jax_cpgrad: GPU " + std::to_string(device) +
                                       " is not part of workspace '" + ws.config.name + "'");
  }
  CallPlan plan;
  TensorPtrs t{};
  if (std::string invalid = check_call(kOp, ws, *m, args, rets, attrs, &plan, &t);
      !invalid.empty()) {
    return ffi::Error::InvalidArgument(invalid);
  }
  // Valid: from here on every rank takes the same steps, so the epochs stay in agreement.
  const auto enqueue = [&](cudaStream_t s) {
    return kProtocol == Protocol::kDevice ? enqueue_fused<kOp>(ws, *m, plan, t, s)
                                          : enqueue_stream_memops<kOp>(ws, *m, plan, t, s);
  };
  if constexpr (kPhase == Phase::kWhole) {
    return enqueue(stream);
  } else {
    CallStream& own = *m->call_stream;
    const CallStream::Lock lock = own.hold();
    if (cudaError_t err = own.follow(lock, stream); err != cudaSuccess) {
      return launch_error(err, "the wait for the call's inputs");
    }
    ffi::Error enqueued = enqueue(own.stream());
    cudaError_t marked =
        own.mark_started(lock, call_buffers(t, plan.tensors, plan.payload_bytes() == 0));
    if (enqueued.failure() || marked != cudaSuccess) {
      // XLA abandons the execution and reuses its buffers: not before what did reach our stream.
      own.join_unchecked(lock, stream);
      return enqueued.failure() ? std::move(enqueued) : launch_error(marked, "the call's event");
    }
    return ffi::Error::Success();
  }
}

// The done of a pair: checks that it was handed the start's results and inputs, the very buffers
// (XLA keeps the inputs alive until here, and the results placed the done after the work tied to
// them), and makes XLA's stream wait for the start's work; result: a token, which releases the
// start's results (peer_transport.py). It writes nothing: the results are the start's own
// buffers, which XLA is free to place anywhere (a scan's stacked output, say) because it never
// has to move them between start and done.
ffi::Error Done(cudaStream_t stream, int32_t device, CallState* state, ffi::RemainingArgs args,
                ffi::RemainingRets, CallAttrs) {
  const WorkspaceState& ws = *state->ws;
  Member* m = ws.member_for_device(device);
  if (m == nullptr || m->call_stream == nullptr) {
    return ffi::Error::InvalidArgument("jax_cpgrad_done: workspace '" + ws.config.name +
                                       "' has no call stream on GPU " + std::to_string(device) +
                                       " (create it with overlap=True)");
  }
  const size_t count = args.size() / 2;
  if (count == 0 || count > static_cast<size_t>(kMaxTensors) || args.size() != 2 * count) {
    return ffi::Error::InvalidArgument(
        "jax_cpgrad_done: expected the start's results and inputs (2 x 1 to " +
        std::to_string(kMaxTensors) + " arguments), got " + std::to_string(args.size()));
  }
  TensorPtrs t{};
  bool empty = false;
  for (size_t k = 0; k < count; ++k) {
    auto result = args.get<ffi::AnyBuffer>(k);
    auto input = args.get<ffi::AnyBuffer>(count + k);
    if (!result || !input) return ffi::Error::InvalidArgument("jax_cpgrad_done: not a buffer");
    t.out[k] = static_cast<char*>(result->untyped_data());
    t.in[k] = static_cast<const char*>(input->untyped_data());
    empty = empty || result->size_bytes() == 0;
  }
  if (ws.test_skip_join.load(std::memory_order_relaxed)) return ffi::Error::Success();
  CallStream& own = *m->call_stream;
  const CallStream::Lock lock = own.hold();
  std::string problem = own.join(lock, call_buffers(t, static_cast<int64_t>(count), empty), stream);
  return problem.empty() ? ffi::Error::Success()
                         : ffi::Error::Internal("jax_cpgrad_done: " + problem);
}

}  // namespace

void* call_state_type_id() { return &CallState::id; }
const void* call_state_type_info() { return &kCallStateTypeInfo; }

}  // namespace jax_cpgrad

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxCpgradInstantiate, jax_cpgrad::Instantiate,
                              xla::ffi::Ffi::BindInstantiate().Attrs<jax_cpgrad::CallAttrs>());

#define CPG_BIND_EXECUTE                                                                  \
  xla::ffi::Ffi::Bind()                                                                   \
      .Ctx<xla::ffi::PlatformStream<cudaStream_t>>() /* XLA's stream for this device */   \
      .Ctx<xla::ffi::DeviceOrdinal>()                /* which local GPU is calling */     \
      .Ctx<xla::ffi::State<jax_cpgrad::CallState>>() /* the workspace (instantiate) */    \
      .RemainingArgs()                               /* inputs: dK, dV, ... same shape */ \
      .RemainingRets()                               /* one output per input */           \
      .Attrs<jax_cpgrad::CallAttrs>()                /* workspace_id, axis_size, seq_axis */

// (The macro also static_asserts that each symbol really is an XLA FFI handler.)
#define CPG_EXECUTE(op, protocol, phase)                                       \
  (jax_cpgrad::Execute<jax_cpgrad::OpKind::op, jax_cpgrad::Protocol::protocol, \
                       jax_cpgrad::Phase::phase>)
// Memop protocol: no command-buffer trait (its epochs are chosen on the host per call, and a
// captured graph would replay stale epochs whose waits already pass).
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxCpgradGradReturn, CPG_EXECUTE(kGradReturn, kStreamMemops, kWhole),
                              CPG_BIND_EXECUTE);
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxCpgradAllGather, CPG_EXECUTE(kAllGather, kStreamMemops, kWhole),
                              CPG_BIND_EXECUTE);
// Device protocol: the kernel reads and advances its epoch itself, so a replayed graph is right.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxCpgradGradReturnDevice, CPG_EXECUTE(kGradReturn, kDevice, kWhole),
                              CPG_BIND_EXECUTE, {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxCpgradAllGatherDevice, CPG_EXECUTE(kAllGather, kDevice, kWhole),
                              CPG_BIND_EXECUTE, {xla::ffi::Traits::kCmdBufferCompatible});
// Starts and the done of overlapped workspaces: never in a CUDA graph (a start forks work onto the
// workspace's stream that only its done, another command, joins back).
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxCpgradGradReturnStart,
                              CPG_EXECUTE(kGradReturn, kStreamMemops, kStart), CPG_BIND_EXECUTE);
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxCpgradAllGatherStart,
                              CPG_EXECUTE(kAllGather, kStreamMemops, kStart), CPG_BIND_EXECUTE);
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxCpgradGradReturnDeviceStart,
                              CPG_EXECUTE(kGradReturn, kDevice, kStart), CPG_BIND_EXECUTE);
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxCpgradAllGatherDeviceStart,
                              CPG_EXECUTE(kAllGather, kDevice, kStart), CPG_BIND_EXECUTE);
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxCpgradDone, jax_cpgrad::Done, CPG_BIND_EXECUTE);
