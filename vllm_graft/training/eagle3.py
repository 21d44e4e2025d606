"""An EAGLE-3 head in plain torch, trained with training-time test, saved in the layout
vLLM's ``LlamaForCausalLMEagle3`` loads.

The forward pass mirrors vLLM's ``llama_eagle3`` exactly (so what is trained is what is
served): ``fc`` fuses the target's three auxiliary hidden states; one decoder layer
takes ``[input_layernorm(embed(token)), hidden_norm(hidden)]`` (2H wide) into attention,
with the un-normed hidden as residual; the pre-norm output is the next step's hidden
state and the normed one feeds ``lm_head`` over a reduced draft vocabulary (``d2t`` /
``t2d`` map it to the target's ids). The embedding is the target's, frozen and shared.

Training-time test (EAGLE-3): step 1 predicts token ``r + 2`` at anchor ``r`` from the
target's features; step ``k`` feeds the head its own step ``k - 1`` output and the true
token ``r + k`` at position ``r + k - 1``, attending to the step-1 rows up to ``r`` and
to its own earlier steps for the same anchor: exactly the context a tree node of depth
``k`` sees at inference. The loss is the cross-entropy against the target's own
next-token distribution (restricted to the draft vocabulary).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class HeadShape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    rms_eps: float
    rope_theta: float
    max_positions: int

    @classmethod
    def from_target(cls, config: dict) -> HeadShape:
        rope = config.get("rope_parameters") or {}
        heads = config["num_attention_heads"]
        return cls(hidden=config["hidden_size"], heads=heads,
                   kv_heads=config.get("num_key_value_heads", heads),
                   head_dim=config.get("head_dim") or config["hidden_size"] // heads,
                   intermediate=config["intermediate_size"], vocab=config["vocab_size"],
                   rms_eps=config.get("rms_norm_eps", 1e-6),
                   rope_theta=float(config.get("rope_theta", rope.get("rope_theta", 10000.0))),
                   max_positions=config.get("max_position_embeddings", 4096))


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x).to(dtype)


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Neox-style RoPE (the Llama/Qwen convention of vLLM). x: [..., T, D]; positions [..., T]."""
    dim = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, device=x.device, dtype=torch.float32) / dim))
    angles = positions.float().unsqueeze(-1) * inv  # [..., T, D/2]
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x[..., :dim // 2].float(), x[..., dim // 2:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class Eagle3Head(nn.Module):
    def __init__(self, shape: HeadShape, embed: torch.Tensor, draft_ids: torch.Tensor,
                 aux_layers: tuple[int, ...]):
        super().__init__()
        h, s = shape.hidden, shape
        self.shape, self.aux_layers = shape, tuple(aux_layers)
        self.register_buffer("embed", embed, persistent=False)  # target's, frozen
        self.register_buffer("draft_ids", draft_ids, persistent=False)
        self.fc = nn.Linear(len(aux_layers) * h, h, bias=False)
        self.input_layernorm = RMSNorm(h, s.rms_eps)
        self.hidden_norm = RMSNorm(h, s.rms_eps)
        self.q_proj = nn.Linear(2 * h, s.heads * s.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * h, s.kv_heads * s.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * h, s.kv_heads * s.head_dim, bias=False)
        self.o_proj = nn.Linear(s.heads * s.head_dim, h, bias=False)
        self.post_attention_layernorm = RMSNorm(h, s.rms_eps)
        self.gate_proj = nn.Linear(h, s.intermediate, bias=False)
        self.up_proj = nn.Linear(h, s.intermediate, bias=False)
        self.down_proj = nn.Linear(s.intermediate, h, bias=False)
        self.norm = RMSNorm(h, s.rms_eps)
        self.lm_head = nn.Linear(h, len(draft_ids), bias=False)

    # ---- one decoder layer, split around attention ------------------------------------
    def _qkv(self, tokens, hidden, positions):
        s = self.shape
        x = torch.cat([self.input_layernorm(self.embed[tokens].to(hidden.dtype)),
                       self.hidden_norm(hidden)], dim=-1)
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, s.heads, s.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, s.kv_heads, s.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, s.kv_heads, s.head_dim).transpose(1, 2)
        pos = positions.unsqueeze(1)
        return rotate(q, pos, s.rope_theta), rotate(k, pos, s.rope_theta), v

    def _finish(self, attn, residual):
        b, _, t, _ = attn.shape
        residual = self.o_proj(attn.transpose(1, 2).reshape(b, t, -1)) + residual
        mlp_in = self.post_attention_layernorm(residual)
        prenorm = self.down_proj(F.silu(self.gate_proj(mlp_in)) * self.up_proj(mlp_in)) + residual
        return self.norm(prenorm), prenorm

    def _repeat(self, x):
        groups = self.shape.heads // self.shape.kv_heads
        return x.repeat_interleave(groups, dim=1) if groups > 1 else x

    def forward_ttt(self, tokens, aux, valid, steps: int):
        """tokens [B, L]; aux [B, L, n_aux, H]; valid [B, L] bool (non-padding).

        Returns a list over steps of (post-norm hidden [B, L, H]) where row r of step k
        is the prediction made at anchor r for token r + k + 1."""
        b, length = tokens.shape
        anchors = torch.arange(length, device=tokens.device).expand(b, length)
        hidden = self.fc(aux.flatten(2))  # step-1 hidden: fused target features
        scale = 1.0 / math.sqrt(self.shape.head_dim)
        keys1 = values1 = None
        diag_k, diag_v = [], []
        outputs = []
        causal = torch.tril(torch.ones(length, length, dtype=torch.bool, device=tokens.device))
        key_ok = causal.unsqueeze(0) & valid.unsqueeze(1)  # [B, L(query), L(key)]
        for step in range(1, steps + 1):
            shifted = torch.roll(tokens, -step, dims=1)  # token r + step at anchor r
            q, k, v = self._qkv(shifted, hidden, anchors + step - 1)
            k, v = self._repeat(k), self._repeat(v)
            if step == 1:
                keys1, values1 = k, v
            else:
                diag_k.append(k)
                diag_v.append(v)
            scores = (q @ keys1.transpose(-1, -2)) * scale  # [B, h, L, L]
            scores = scores.masked_fill(~key_ok.unsqueeze(1), float("-inf"))
            extra = [((q * dk).sum(-1, keepdim=True) * scale) for dk in diag_k]  # same anchor
            probs = torch.cat([scores, *extra], dim=-1).float().softmax(-1).to(q.dtype)
            attn = probs[..., :length] @ values1
            for j, dv in enumerate(diag_v):
                attn = attn + probs[..., length + j:length + j + 1] * dv
            out, hidden = self._finish(attn, hidden)
            outputs.append(out)
        return outputs

    def draft_logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.lm_head(out)

    # ---- the vLLM layout ---------------------------------------------------------------
    def save_vllm(self, out_dir: Path, target_config: dict) -> Path:
        from safetensors.torch import save_file

        s = self.shape
        out_dir.mkdir(parents=True, exist_ok=True)
        ids = self.draft_ids.cpu()
        dtype = torch.bfloat16
        w = lambda m: m.weight.detach().to(dtype).contiguous().cpu()
        tensors = {
            "fc.weight": w(self.fc),
            "midlayer.input_layernorm.weight": w(self.input_layernorm),
            "midlayer.hidden_norm.weight": w(self.hidden_norm),
            "midlayer.post_attention_layernorm.weight": w(self.post_attention_layernorm),
            "midlayer.self_attn.q_proj.weight": w(self.q_proj),
            "midlayer.self_attn.k_proj.weight": w(self.k_proj),
            "midlayer.self_attn.v_proj.weight": w(self.v_proj),
            "midlayer.self_attn.o_proj.weight": w(self.o_proj),
            "midlayer.mlp.gate_proj.weight": w(self.gate_proj),
            "midlayer.mlp.up_proj.weight": w(self.up_proj),
            "midlayer.mlp.down_proj.weight": w(self.down_proj),
            "norm.weight": w(self.norm),
            "lm_head.weight": w(self.lm_head),
            "d2t": ids - torch.arange(len(ids)),  # offsets, as vLLM expects
            "t2d": torch.zeros(s.vocab, dtype=torch.bool).index_fill_(0, ids, True),
        }
        save_file(tensors, out_dir / "model.safetensors")
        config = {
            "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
            "hidden_size": s.hidden, "intermediate_size": s.intermediate,
            "num_attention_heads": s.heads, "num_key_value_heads": s.kv_heads,
            "head_dim": s.head_dim, "num_hidden_layers": 1, "vocab_size": s.vocab,
            "draft_vocab_size": len(ids), "target_hidden_size": s.hidden,
            "rms_norm_eps": s.rms_eps, "max_position_embeddings": s.max_positions,
            "rope_theta": s.rope_theta, "hidden_act": "silu", "tie_word_embeddings": False,
            "attention_bias": False, "torch_dtype": "bfloat16",
            "bos_token_id": target_config.get("bos_token_id"),
            "eos_token_id": target_config.get("eos_token_id"),
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(self.aux_layers),
                             "use_aux_hidden_state": True},
        }
        (out_dir / "config.json").write_text(json.dumps(config, indent=2))
        return out_dir
