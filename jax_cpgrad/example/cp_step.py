"""Moved: :mod:`jax_cpgrad.models.cp_train_step` (a shim; see ``__init__.py``)."""

from ..models.cp_train_step import local_value, make_train_step, replicate, shard_batch, workspace_nbytes

__all__ = ["local_value", "make_train_step", "replicate", "shard_batch", "workspace_nbytes"]
