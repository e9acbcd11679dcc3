"""The context-parallel attention layer: :func:`dot_product_attention` inside ``jax.shard_map``.

- ``layer.py``: the public function, its checks and the choice of kernels;
- ``plan.py``: which of a rank's queries meet which keys (a local and a remote part);
- ``split_attention.py``: the two parts merged by log-sum-exp, the transfer beside the local
  part (or pipelined over head groups), and the exact backward;
- ``kernels.py``: one block of attention with its log-sum-exp (cuDNN or XLA);
- ``transfer.py``: the K/V gather and the dK/dV return, with work beside them;
- ``public_path.py``: the fallback through public jax API only.
"""

from .layer import attention_workspace_nbytes, dot_product_attention, rank_without_transfer

__all__ = ["attention_workspace_nbytes", "dot_product_attention", "rank_without_transfer"]
