"""Models built on the CP attention layer: ``transformer.py``, a configurable causal transformer
(the reference runs it unsharded), and ``cp_train_step.py``, its context-parallel training step.
The demo, ``examples/train_cp_transformer.py``, the tests and ``benchmarks/cp_step.py`` use them."""
