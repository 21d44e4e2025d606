"""Patch 12: tree attention on an attention implementation's ``forward``.

The CPU backend is patched at plugin load (:mod:`vllm_graft.vllm.patches`); on other
platforms the implementation in use is patched when a Graft runner creates its KV cache
(:mod:`vllm_graft.vllm.replacements.runner_lifecycle`). Both build the patch here."""

from __future__ import annotations

from vllm_graft.vllm.patching import Patch, call_original
from vllm_graft.vllm.tree_attention import tree_attention_forward


def tree_attention_patch(impl_cls) -> Patch:
    """Tree attention on ``impl_cls.forward`` (inert without an active tree plan)."""
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                *args, **kwargs):
        original = call_original(impl_cls, "forward")
        return tree_attention_forward(original, self, layer, query, key, value, kv_cache,
                                      attn_metadata, output, *args, **kwargs)

    return Patch(f"graft.tree_attention.{impl_cls.__name__}", impl_cls, {"forward": forward},
                 must_exist=frozenset({"forward", "do_kv_cache_update"}))
