"""Moved to :mod:`jax_cpgrad.models` (``model`` -> ``transformer``, ``cp_step`` -> ``cp_train_step``).

A shim while tests/test_lowering.py and tests/test_launch.py still import the old names; delete
this folder once they import ``jax_cpgrad.models``.
"""
