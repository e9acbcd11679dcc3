"""Moved: :mod:`jax_cpgrad.models.transformer` (a shim; see ``__init__.py``)."""

from ..models.transformer import Config, forward_loss, init_params, reference_loss_and_grads, synthetic_batch

__all__ = ["Config", "forward_loss", "init_params", "reference_loss_and_grads", "synthetic_batch"]
