"""Attention kernels of Graft that run without vLLM (plain torch, and Triton on GPUs).

``paged_tree_attention`` (Triton) and ``paged_tree_attention_reference`` (torch SDPA)
compute the same thing: attention of a flattened batch of query rows over vLLM-style
paged K/V, causal for ordinary rows and ancestor-masked for the rows of a token tree.
The reference needs no Triton, so this package imports without it.
"""

from vllm_graft.kernels.tree_mask import pack_ancestor_bits
from vllm_graft.kernels.tree_attention_reference import paged_tree_attention_reference

__all__ = ["pack_ancestor_bits", "paged_tree_attention_reference"]
