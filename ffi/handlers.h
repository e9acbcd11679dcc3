// The XLA FFI handlers of the peer transport (registered from Python for platform CUDA).
#pragma once

#include "xla/ffi/api/api.h"

// jax_cpgrad_grad_return: global dK/dV/... in, local (owner) sums out.
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxCpgradGradReturn);
// jax_cpgrad_all_gather: local K/V/... in, global (natural order) out.
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxCpgradAllGather);
