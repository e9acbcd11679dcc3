// The XLA FFI handlers (registered from Python for platform CUDA). Each target is a bundle of an
// instantiate stage, which binds the executable to its workspace once (FFI state), and an execute
// stage. Two protocols, two targets per op:
//   jax_cpgrad_<op>         memop protocol: host-chosen epochs, so side-effecting and
//                           never recorded into a CUDA graph;
//   jax_cpgrad_<op>_device  device protocol: one kernel, device-resident epochs, the same launch
//                           every call, so command-buffer compatible (XLA records it into graphs).
// A workspace created with overlap=True takes each call as a pair instead (call_stream.h):
//   jax_cpgrad_<op>[_device]_start  checks the call and enqueues the protocol on the workspace's
//                                   stream;
//   jax_cpgrad_done                 makes XLA's stream wait for it (one target for every op).
#pragma once

#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxCpgradInstantiate);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxCpgradGradReturn);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxCpgradAllGather);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxCpgradGradReturnDevice);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxCpgradAllGatherDevice);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxCpgradGradReturnStart);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxCpgradAllGatherStart);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxCpgradGradReturnDeviceStart);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxCpgradAllGatherDeviceStart);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxCpgradDone);

namespace jax_cpgrad {
// The FFI state type every target's instantiate stage creates (registered with
// jax.ffi.register_ffi_type): its TypeId and TypeInfo.
void* call_state_type_id();
const void* call_state_type_info();
}  // namespace jax_cpgrad
