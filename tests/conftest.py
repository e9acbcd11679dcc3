import os

# Eight CPU devices for the XLA-transport tests; must happen before JAX starts a backend.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
