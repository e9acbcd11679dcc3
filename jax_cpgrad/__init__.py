"""jax_cpgrad: context-parallel attention for JAX, with K/V and dK/dV moved without NCCL.

``dot_product_attention`` is the CP attention layer (inside ``jax.shard_map``), with documents
and sliding windows; ``balanced_document_order`` evens out the ranks' work for packed documents.
Underneath it, ``grad_return`` returns each rank's share of the global dK/dV to its owner in the
load-balanced CP layout; ``all_gather`` is its inverse (and its VJP). With a :class:`Workspace`
they run over the peer transport, an XLA FFI CUDA handler on XLA's own stream; without one, over
XLA collectives.
"""

from ._native import HAS_CUDA
from ._version import __version__ as __version__
from .api import all_gather, all_gather_overlapped, grad_return, grad_return_overlapped, grad_return_reference
from .attention import (
    MASKS_CHECKPOINT_NAME,
    attention_workspace_nbytes,
    dot_product_attention,
    masks_checkpoint_policy,
)
from .document_layout import balanced_document_order, longest_document, permute_tokens, unpermute_tokens
from .layout import from_cp_layout, layout_order, local_chunks, to_cp_layout
from .workspace import Workspace, workspace_bytes

__all__ = [
    "HAS_CUDA",
    "MASKS_CHECKPOINT_NAME",
    "Workspace",
    "all_gather",
    "attention_workspace_nbytes",
    "balanced_document_order",
    "dot_product_attention",
    "all_gather_overlapped",
    "from_cp_layout",
    "grad_return",
    "grad_return_overlapped",
    "grad_return_reference",
    "layout_order",
    "local_chunks",
    "longest_document",
    "masks_checkpoint_policy",
    "permute_tokens",
    "to_cp_layout",
    "unpermute_tokens",
    "workspace_bytes",
]
