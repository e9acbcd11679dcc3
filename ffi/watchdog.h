// The watchdog: one host thread per process that notices a wait no peer satisfies. When a
// device has sat at the same call's wait for longer than its workspace's timeout, it names the
// call and the missing peers, marks the workspace failed (later calls return that error), sets
// the region's error word (the stuck call's outputs become NaN) and releases the wait, so the
// GPU never hangs. A slow peer that arrives within the timeout is never reported.
#pragma once

namespace jax_cpgrad {

void watchdog_start();  // idempotent
void watchdog_stop();   // joins the thread; call before interpreter exit

}  // namespace jax_cpgrad
