"""The context-parallel attention layer: :func:`dot_product_attention` inside ``jax.shard_map``.

Imports go one way, down this list:

- ``layer.py``: the public function: its checks, the mask normalised, a kernel chosen;
- ``emulation.py``: a rank without transfers, for benchmarks (:func:`rank_without_transfer`);
- ``schedule.py``: the custom VJP: the calls beside the transfers, the log-sum-exp merge of the
  parts, the exact backward;
- ``plan.py``: the rank's kernel calls (a local and a remote part), returned as data;
- ``transfer.py``: the K/V gather, the dK/dV return and the segment ids' gather;
- ``kernels/``: one block of attention with its log-sum-exp (``contract.py``), XLA and cuDNN;
- ``masks.py``: causal, windows and documents as data in global positions;
- ``checkpointing.py``: the masks' name for ``jax.checkpoint`` policies, and a policy that keeps them.
"""

from .checkpointing import MASKS_CHECKPOINT_NAME, masks_checkpoint_policy
from .emulation import rank_without_transfer
from .layer import attention_workspace_nbytes, dot_product_attention

__all__ = [
    "MASKS_CHECKPOINT_NAME",
    "attention_workspace_nbytes",
    "dot_product_attention",
    "masks_checkpoint_policy",
    "rank_without_transfer",
]
