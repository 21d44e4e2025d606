"""A DFlash block drafter trained in plain torch (CPU-friendly), in the exact layout
vLLM 0.32's ``DFlashQwen3ForCausalLM`` loads (architecture ``DFlashDraftModel``).

What vLLM runs (``vllm/model_executor/models/qwen3_dflash.py``,
``vllm/v1/spec_decode/dflash.py``), and so what this module trains:

* **Context.** The target's hidden states at ``dflash_config.target_layer_ids`` (id
  ``t``: the output of target layer ``t``, i.e. transformers' ``hidden_states[t + 1]``,
  vLLM's auxiliary layer ``t + 1``), concatenated and fused by ``fc``, are normed by
  ``hidden_norm`` and projected by every drafter layer's own ``k_proj`` / ``v_proj``
  (``k_norm`` and RoPE on K) into that layer's K/V cache, at the context tokens'
  positions. The context is never run through the drafter's layers.
* **Queries.** A block is ``1 + K`` query tokens at positions ``p .. p + K``: the token
  the target just produced (the "bonus" token ``x_p``) and ``K`` mask tokens
  (``dflash_config.mask_token_id``, embedded by ``mask_embedding.pt`` when shipped).
  Embeddings and LM head are the target's own (the checkpoint ships neither). The
  queries run through Qwen3 decoder layers (``q_norm`` / ``k_norm`` per head, RoPE,
  GQA, SwiGLU) and attend to the context at positions ``< p`` and, causally
  (``dflash_config.causal``, the only attention vLLM's CPU backend offers), to the
  block's own earlier queries; ``norm`` and the target's LM head give, at mask ``j``,
  the drafter's guess of ``x_{p + j}``. One forward proposes the whole block.

Training follows DFlash: random anchors ``p`` in the target's own answers, many blocks
per sequence in one forward (each block masked to its own prefix of the context), and
cross-entropy on the ``K`` mask positions against the target's greedy tokens, weighted
``exp(-(j - 1) / gamma)`` since a block is accepted only up to its first miss. The
full-vocabulary LM head is most of the cost on a CPU, so by default position ``j`` is
kept with probability ``exp(-(j - 1) / gamma)`` and the kept ones weigh the same: the
weighted loss in expectation, for about half the LM-head work at block 8. Only
the drafter's own weights (``fc``, ``hidden_norm``, its layers, ``norm``, the mask
embedding) are trained; the target's embeddings and LM head stay frozen.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from vllm_graft.training.data import load_shards


def default_target_layer_ids(num_target_layers: int, count: int = 5) -> list[int]:
    """``count`` target layers spread evenly from layer 1 to layer ``L - 3`` (DFlash's
    own choice; layers 0 .. ``L - 2`` for targets too shallow for that). DFlash ids:
    the output of layer ``t`` (vLLM reads it as auxiliary layer ``t + 1``)."""
    lo, hi = (1, num_target_layers - 3) if num_target_layers >= 8 else (0, num_target_layers - 2)
    count = max(1, min(count, hi - lo + 1))
    if count == 1:
        return [(lo + hi) // 2]
    return sorted({int(round(lo + i * (hi - lo) / (count - 1))) for i in range(count)})


def feature_layers(target_layer_ids: list[int]) -> tuple[int, ...]:
    """The indices of transformers' ``hidden_states`` that hold those layers' outputs
    (what :func:`vllm_graft.training.data.extract_features` stores as ``aux``)."""
    return tuple(t + 1 for t in target_layer_ids)


@dataclass(frozen=True)
class DrafterShape:
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    rms_eps: float
    rope_theta: float
    max_positions: int
    layers: int
    features: int  # number of target layers fused by fc

    @classmethod
    def from_target(cls, config: dict, *, layers: int, features: int) -> "DrafterShape":
        heads = config["num_attention_heads"]
        rope = config.get("rope_parameters") or {}
        return cls(hidden=config["hidden_size"], intermediate=config["intermediate_size"],
                   heads=heads, kv_heads=config.get("num_key_value_heads", heads),
                   head_dim=config.get("head_dim") or config["hidden_size"] // heads,
                   vocab=config["vocab_size"], rms_eps=float(config.get("rms_norm_eps", 1e-6)),
                   rope_theta=float(config.get("rope_theta") or rope.get("rope_theta", 10000.0)),
                   max_positions=config.get("max_position_embeddings", 4096),
                   layers=layers, features=features)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style RoPE (halves rotated), vLLM's ``is_neox_style=True``; ``x`` is
    ``[..., T, heads, D]``, ``cos`` / ``sin`` ``[..., T, 1, D]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class DrafterLayer(nn.Module):
    def __init__(self, s: DrafterShape):
        super().__init__()
        self.s = s
        h, d = s.hidden, s.head_dim
        self.input_layernorm = nn.Parameter(torch.ones(h))
        self.post_attention_layernorm = nn.Parameter(torch.ones(h))
        self.q_proj = nn.Linear(h, s.heads * d, bias=False)
        self.k_proj = nn.Linear(h, s.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, s.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(s.heads * d, h, bias=False)
        self.q_norm = nn.Parameter(torch.ones(d))
        self.k_norm = nn.Parameter(torch.ones(d))
        self.gate_proj = nn.Linear(h, s.intermediate, bias=False)
        self.up_proj = nn.Linear(h, s.intermediate, bias=False)
        self.down_proj = nn.Linear(s.intermediate, h, bias=False)

    def keys(self, x: torch.Tensor, cos, sin) -> torch.Tensor:
        k = self.k_proj(x).unflatten(-1, (self.s.kv_heads, self.s.head_dim))
        return rotate(rms_norm(k, self.k_norm, self.s.rms_eps), cos, sin)

    def values(self, x: torch.Tensor) -> torch.Tensor:
        return self.v_proj(x).unflatten(-1, (self.s.kv_heads, self.s.head_dim))

    def forward(self, x, ctx_k, ctx_v, cos, sin, mask):
        """``x`` [B, Q, H] query states; ``ctx_k`` / ``ctx_v`` [B, T, kv, D] this layer's
        context K/V; ``mask`` [B, Q, T + Q] (True: attend)."""
        s = self.s
        h = rms_norm(x, self.input_layernorm, s.rms_eps)
        q = self.q_proj(h).unflatten(-1, (s.heads, s.head_dim))
        q = rotate(rms_norm(q, self.q_norm, s.rms_eps), cos, sin)
        k = torch.cat([ctx_k, self.keys(h, cos, sin)], dim=1)
        v = torch.cat([ctx_v, self.values(h)], dim=1)
        groups = s.heads // s.kv_heads
        k = k.repeat_interleave(groups, dim=2)
        v = v.repeat_interleave(groups, dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), attn_mask=mask[:, None])
        x = x + self.o_proj(out.transpose(1, 2).flatten(-2))
        h = rms_norm(x, self.post_attention_layernorm, s.rms_eps)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class DFlashDrafter(nn.Module):
    """The trainable drafter; ``embed`` / ``lm_head`` are the target's (frozen)."""

    def __init__(self, shape: DrafterShape, embed: torch.Tensor, lm_head: torch.Tensor,
                 mask_token_id: int, seed: int = 0):
        super().__init__()
        self.s = shape
        self.mask_token_id = mask_token_id
        self.register_buffer("embed", embed, persistent=False)
        self.register_buffer("lm_head", lm_head, persistent=False)
        self.fc = nn.Linear(shape.features * shape.hidden, shape.hidden, bias=False)
        self.hidden_norm = nn.Parameter(torch.ones(shape.hidden))
        self.layers = nn.ModuleList(DrafterLayer(shape) for _ in range(shape.layers))
        self.norm = nn.Parameter(torch.ones(shape.hidden))
        self.mask_embedding = nn.Parameter(embed[mask_token_id].clone())
        inv = 1.0 / (shape.rope_theta ** (torch.arange(0, shape.head_dim, 2).float()
                                          / shape.head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)
        g = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / (math.sqrt(2 * shape.layers) if name.endswith(
                    ("o_proj.weight", "down_proj.weight")) else 1.0)
                with torch.no_grad():
                    p.copy_(torch.randn(p.shape, generator=g) * std)

    def rope(self, positions: torch.Tensor):
        angles = positions.float()[..., None] * self.inv_freq
        angles = torch.cat([angles, angles], dim=-1)[..., None, :]  # [..., T, 1, D]
        return angles.cos(), angles.sin()

    def embed_queries(self, tokens: torch.Tensor) -> torch.Tensor:
        x = F.embedding(tokens, self.embed)
        is_mask = (tokens == self.mask_token_id)[..., None]
        return torch.where(is_mask, self.mask_embedding.to(x.dtype), x)

    def forward(self, tokens, aux, lengths, anchors, anchor_valid, block: int):
        """Final (normed) states of every block's mask queries, ``[B, N, block, H]``.

        ``tokens`` [B, T]; ``aux`` [B, T, F * H] the target's features; ``lengths`` [B];
        ``anchors`` [B, N] positions ``p`` (block ``x_p, mask x block``), ``anchor_valid``
        [B, N]."""
        b, t = tokens.shape
        n = anchors.shape[1]
        span = block + 1
        ctx = rms_norm(self.fc(aux), self.hidden_norm, self.s.rms_eps)  # [B, T, H]
        ctx_cos, ctx_sin = self.rope(torch.arange(t).expand(b, t))
        offsets = torch.arange(span)
        q_pos = (anchors[..., None] + offsets).reshape(b, n * span)  # [B, Q]
        q_cos, q_sin = self.rope(q_pos)
        q_tokens = torch.full((b, n, span), self.mask_token_id, dtype=torch.long)
        q_tokens[..., 0] = tokens.gather(1, anchors)
        x = self.embed_queries(q_tokens.reshape(b, n * span))
        # attention: context before the block's anchor (and within the sequence), then the
        # block's own queries up to this one
        ctx_ok = (torch.arange(t)[None, None, :] < anchors.reshape(b, n, 1)) \
            & (torch.arange(t)[None, None, :] < lengths[:, None, None])  # [B, N, T]
        ctx_ok = ctx_ok[:, :, None, :].expand(b, n, span, t).reshape(b, n * span, t)
        block_id = torch.arange(n).repeat_interleave(span)
        causal = (block_id[:, None] == block_id[None, :]) \
            & (offsets.repeat(n)[:, None] >= offsets.repeat(n)[None, :])
        self_ok = causal[None].expand(b, -1, -1)
        # padded blocks attend to themselves only (no empty rows; their loss is masked)
        ctx_ok = ctx_ok & anchor_valid.repeat_interleave(span, dim=1)[:, :, None]
        mask = torch.cat([ctx_ok, self_ok], dim=-1)
        for layer in self.layers:
            x = layer(x, layer.keys(ctx, ctx_cos, ctx_sin), layer.values(ctx), q_cos, q_sin,
                      mask)
        x = rms_norm(x, self.norm, self.s.rms_eps)
        return x.view(b, n, span, -1)[:, :, 1:]

    def logits(self, states: torch.Tensor) -> torch.Tensor:
        return states @ self.lm_head.T

    def vllm_parameters(self) -> dict[str, torch.Tensor]:
        """The checkpoint's tensors by the names ``DFlashQwen3ForCausalLM.load_weights``
        expects (no ``model.`` prefix, no embeddings or LM head: vLLM shares the
        target's)."""
        out = {"fc.weight": self.fc.weight, "hidden_norm.weight": self.hidden_norm,
               "norm.weight": self.norm}
        for i, layer in enumerate(self.layers):
            p = f"layers.{i}."
            out.update({
                p + "input_layernorm.weight": layer.input_layernorm,
                p + "post_attention_layernorm.weight": layer.post_attention_layernorm,
                p + "self_attn.q_proj.weight": layer.q_proj.weight,
                p + "self_attn.k_proj.weight": layer.k_proj.weight,
                p + "self_attn.v_proj.weight": layer.v_proj.weight,
                p + "self_attn.o_proj.weight": layer.o_proj.weight,
                p + "self_attn.q_norm.weight": layer.q_norm,
                p + "self_attn.k_norm.weight": layer.k_norm,
                p + "mlp.gate_proj.weight": layer.gate_proj.weight,
                p + "mlp.up_proj.weight": layer.up_proj.weight,
                p + "mlp.down_proj.weight": layer.down_proj.weight,
            })
        return out

    @classmethod
    def from_vllm(cls, drafter_dir: Path, target_dir: Path) -> "DFlashDrafter":
        """A saved drafter back in torch (fp32), with the target's embeddings and head."""
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM

        config = json.loads((Path(drafter_dir) / "config.json").read_text())
        target_config = json.loads((Path(target_dir) / "config.json").read_text())
        dflash = config["dflash_config"]
        shape = DrafterShape.from_target(target_config, layers=config["num_hidden_layers"],
                                         features=len(dflash["target_layer_ids"]))
        target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
        drafter = cls(shape, target.get_input_embeddings().weight.detach().clone(),
                      target.get_output_embeddings().weight.detach().clone(),
                      dflash["mask_token_id"])
        del target
        weights = load_file(Path(drafter_dir) / "model.safetensors")
        with torch.no_grad():
            for name, param in drafter.vllm_parameters().items():
                param.copy_(weights[name].float())
            mask = Path(drafter_dir) / "mask_embedding.pt"
            if mask.is_file():
                drafter.mask_embedding.copy_(torch.load(mask, weights_only=True)["embedding"])
        return drafter.eval()

    def save_vllm(self, out_dir: Path, target_config: dict, *, target_layer_ids: list[int],
                  block: int, dtype: torch.dtype = torch.bfloat16) -> None:
        from safetensors.torch import save_file

        s = self.s
        out_dir.mkdir(parents=True, exist_ok=True)
        weights = {k: v.detach().to(dtype).contiguous()
                   for k, v in self.vllm_parameters().items()}
        save_file(weights, out_dir / "model.safetensors")
        torch.save({"mask_token_id": self.mask_token_id,
                    "embedding": self.mask_embedding.detach().float().clone()},
                   out_dir / "mask_embedding.pt")
        config = {
            "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
            "hidden_size": s.hidden, "intermediate_size": s.intermediate,
            "num_attention_heads": s.heads, "num_key_value_heads": s.kv_heads,
            "head_dim": s.head_dim, "num_hidden_layers": s.layers, "vocab_size": s.vocab,
            "rms_norm_eps": s.rms_eps, "max_position_embeddings": s.max_positions,
            "rope_theta": s.rope_theta,
            "rope_parameters": {"rope_theta": s.rope_theta, "rope_type": "default"},
            "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False,
            "torch_dtype": str(dtype).removeprefix("torch."),
            "bos_token_id": target_config.get("bos_token_id"),
            "eos_token_id": target_config.get("eos_token_id"),
            "num_target_layers": target_config["num_hidden_layers"],
            "block_size": block,
            "dflash_config": {"mask_token_id": self.mask_token_id,
                              "target_layer_ids": list(target_layer_ids), "causal": True},
        }
        (out_dir / "config.json").write_text(json.dumps(config, indent=2))


def choose_mask_token(tokenizer_dir: Path, target_config: dict, sequences: list[dict]) -> int:
    """A token the target never writes, since vLLM swaps the mask embedding in wherever
    the token appears (the block's first token too): the tokenizer's pad token when it
    is neither BOS nor EOS, else its first special token that is neither and does not
    occur in the training data."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    reserved = {target_config.get("bos_token_id"), tok.bos_token_id, tok.eos_token_id}
    eos = target_config.get("eos_token_id")
    reserved.update(eos if isinstance(eos, list) else [eos])
    seen = set()
    for seq in sequences:
        seen.update(seq["tokens"].tolist())
    pad = tok.pad_token_id
    if pad is not None and pad not in reserved and pad not in seen:
        return int(pad)
    for token in sorted(tok.all_special_ids) + sorted(tok.added_tokens_decoder):
        if token not in reserved and token not in seen:
            return int(token)
    raise ValueError("no unused special token to serve as the DFlash mask token")


def _sample_anchors(seq: dict, count: int, block: int, rng: random.Random) -> list[int]:
    """Anchors ``p`` whose block predicts answer tokens: ``p`` itself an answer token
    (the bonus token the target produced), ``p + 1`` still in the sequence."""
    mask = seq["mask"]
    length = len(mask)
    start = int(mask.float().argmax()) if bool(mask.any()) else length
    candidates = list(range(max(start, 1), length - 1))
    if len(candidates) <= count:
        return candidates
    return sorted(rng.sample(candidates, count))


def _collate(sequences, index, anchor_lists, max_len, block):
    length = max(min(len(sequences[i]["tokens"]), max_len) for i in index)
    b, n = len(index), max(1, max(len(a) for a in anchor_lists))
    features, hidden = sequences[index[0]]["aux"].shape[1:]
    tokens = torch.zeros(b, length, dtype=torch.long)
    answer = torch.zeros(b, length, dtype=torch.bool)
    aux = torch.zeros(b, length, features * hidden)
    lengths = torch.zeros(b, dtype=torch.long)
    anchors = torch.zeros(b, n, dtype=torch.long)
    anchor_valid = torch.zeros(b, n, dtype=torch.bool)
    for row, (i, chosen) in enumerate(zip(index, anchor_lists)):
        seq = sequences[i]
        t = min(len(seq["tokens"]), max_len)
        tokens[row, :t] = seq["tokens"][:t]
        answer[row, :t] = seq["mask"][:t]
        aux[row, :t] = seq["aux"][:t].float().flatten(1)
        lengths[row] = t
        chosen = torch.tensor([p for p in chosen if p + 1 < t], dtype=torch.long)
        anchors[row, :len(chosen)] = chosen
        anchor_valid[row, :len(chosen)] = True
    # mask j of the block at p guesses token p + 1 + j, when it is an answer token
    at = anchors[..., None] + 1 + torch.arange(block)  # [B, N, block]
    inside = at < lengths[:, None, None]
    at = at.clamp(max=length - 1).view(b, -1)
    labels = tokens.gather(1, at).view(b, n, block)
    label_ok = answer.gather(1, at).view(b, n, block) & inside & anchor_valid[..., None]
    return tokens, aux, lengths, anchors, anchor_valid, labels, label_ok


def _plan(sequences, order, anchors_per_seq, block, max_len, batch_predictions, rng):
    """Batches of sequences (similar lengths together) and each one's anchors."""
    order = sorted(order, key=lambda i: len(sequences[i]["tokens"]))
    batches, current, chosen, predictions = [], [], [], 0
    for i in order:
        seq = {**sequences[i], "mask": sequences[i]["mask"][:max_len]}
        anchors = _sample_anchors(seq, anchors_per_seq, block, rng)
        if not anchors:
            continue
        cost = len(anchors) * block
        if current and predictions + cost > batch_predictions:
            batches.append((current, chosen))
            current, chosen, predictions = [], [], 0
        current.append(i)
        chosen.append(anchors)
        predictions += cost
    if current:
        batches.append((current, chosen))
    rng.shuffle(batches)
    return batches


def _block_stats(logits_argmax, labels, label_ok):
    """Per position: how often the block's first ``j`` guesses are all right (what
    greedy verification accepts), over blocks whose ``j`` labels all exist."""
    correct = (logits_argmax == labels) & label_ok
    prefix = correct.long().cumprod(-1)
    full = label_ok.long().cumprod(-1)
    return prefix.sum((0, 1)), full.sum((0, 1)), correct.sum((0, 1)), label_ok.sum((0, 1))


@torch.no_grad()
def evaluate(drafter, sequences, index, anchor_lists, block, max_len, batch=4) -> dict:
    prefix = torch.zeros(block)
    full = torch.zeros(block)
    for start in range(0, len(index), batch):
        rows = index[start:start + batch]
        lists = anchor_lists[start:start + batch]
        tokens, aux, lengths, anchors, valid, labels, ok = _collate(
            sequences, rows, lists, max_len, block)
        states = drafter(tokens, aux, lengths, anchors, valid, block)
        guess = drafter.logits(states).argmax(-1)
        p, f, _, _ = _block_stats(guess, labels, ok)
        prefix += p
        full += f
    rate = (prefix / full.clamp(min=1)).tolist()
    return {"acceptance_by_position": [round(r, 4) for r in rate],
            "accepted_per_block": round(sum(rate), 3), "blocks": int(full[0])}


def train_dflash(target_dir: Path, features_dir: Path | list[Path], out_dir: Path, *,
                 target_layer_ids: list[int], layers: int = 2, block: int = 8,
                 epochs: int = 3, lr: float = 6e-4, anchors_per_seq: int = 48,
                 batch_predictions: int = 1536, max_len: int = 640, gamma: float = 4.0,
                 holdout: float = 0.03, seed: int = 0, mask_token_id: int | None = None,
                 save_dtype: torch.dtype = torch.bfloat16, threads: int | None = None,
                 sample_positions: bool = True, log_every: int = 25) -> dict:
    from transformers import AutoModelForCausalLM

    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)
    rng = random.Random(seed)
    target_config = json.loads((target_dir / "config.json").read_text())
    shape = DrafterShape.from_target(target_config, layers=layers,
                                     features=len(target_layer_ids))
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    embed = target.get_input_embeddings().weight.detach().clone()
    lm_head = target.get_output_embeddings().weight.detach().clone()
    del target

    dirs = features_dir if isinstance(features_dir, list) else [features_dir]
    sequences = [seq for d in dirs for seq in load_shards(d)]
    if sequences and sequences[0]["aux"].shape[1] != len(target_layer_ids):
        raise ValueError(f"{dirs[0]} holds {sequences[0]['aux'].shape[1]} target layers, "
                         f"not the {len(target_layer_ids)} of target_layer_ids")
    if mask_token_id is None:
        mask_token_id = choose_mask_token(target_dir, target_config, sequences)
    drafter = DFlashDrafter(shape, embed, lm_head, mask_token_id, seed=seed)

    order = list(range(len(sequences)))
    rng.shuffle(order)
    held = max(1, int(len(order) * holdout)) if len(order) > 8 else 0
    eval_index, train_index = sorted(order[:held]), order[held:]
    eval_anchors = [_sample_anchors({**sequences[i], "mask": sequences[i]["mask"][:max_len]},
                                    anchors_per_seq, block, random.Random(seed + i))
                    for i in eval_index]
    weights = torch.exp(-torch.arange(block, dtype=torch.float32) / gamma)
    draw = torch.Generator().manual_seed(seed)

    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.01, betas=(0.9, 0.95))
    plan = [b for e in range(epochs) for b in _plan(sequences, train_index, anchors_per_seq,
                                                     block, max_len, batch_predictions,
                                                     random.Random(seed + 1000 * (e + 1)))]
    total = len(plan)
    warmup = max(1, min(100, total // 20))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda i: min(1.0, (i + 1) / warmup)
        * max(0.02, 0.5 * (1 + math.cos(math.pi * min(i, total) / max(total, 1)))))
    start = time.time()
    trained_predictions, context_tokens, curve, window = 0, 0, [], []
    progress = tqdm(plan, desc="train dflash", unit="batch")
    for step, (index, anchor_lists) in enumerate(progress, start=1):
        tokens, aux, lengths, anchors, valid, labels, ok = _collate(
            sequences, index, anchor_lists, max_len, block)
        if not ok.any():
            continue
        if sample_positions:  # position j kept with probability w_j: the weighted loss
            ok = ok & (torch.rand(ok.shape, generator=draw) < weights)  # in expectation
            if not ok.any():
                continue
        states = drafter(tokens, aux, lengths, anchors, valid, block)
        logits = drafter.logits(states[ok])
        loss_each = F.cross_entropy(logits, labels[ok], reduction="none")
        if sample_positions:
            loss = loss_each.mean()
        else:
            w = weights.expand_as(labels)[ok]
            loss = (loss_each * w).sum() / w.sum()
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        trained_predictions += int(ok.sum())
        context_tokens += int(lengths.sum())
        with torch.no_grad():
            hit = torch.zeros_like(ok)
            hit[ok] = logits.argmax(-1) == labels[ok]
        window.append((float(loss.detach()), hit.sum((0, 1)), ok.sum((0, 1))))
        window = window[-log_every:]
        if step % log_every == 0 or step == total:
            acc = sum(x[1] for x in window) / sum(x[2] for x in window).clamp(min=1)
            point = {"step": step, "seconds": round(time.time() - start, 1),
                     "loss": round(sum(x[0] for x in window) / len(window), 4),
                     "train_top1_by_position": [round(float(a), 3) for a in acc]}
            curve.append(point)
            progress.set_postfix(loss=point["loss"], acc1=point["train_top1_by_position"][0],
                                 acc2=point["train_top1_by_position"][1])
    elapsed = time.time() - start
    drafter.save_vllm(out_dir, target_config, target_layer_ids=target_layer_ids, block=block,
                      dtype=save_dtype)
    with torch.no_grad():  # evaluate the weights as saved (and as vLLM serves them)
        for p in params:
            if p is not drafter.mask_embedding:
                p.copy_(p.to(save_dtype).float())
    held_out = evaluate(drafter, sequences, eval_index, eval_anchors, block, max_len) \
        if eval_index else None
    report = {
        "target": target_dir.name, "layers": layers, "block": block,
        "target_layer_ids": list(target_layer_ids), "mask_token_id": mask_token_id,
        "epochs": epochs, "anchors_per_sequence": anchors_per_seq, "gamma": gamma,
        "sampled_positions": sample_positions,
        "lr": lr, "batches": total, "sequences": len(sequences),
        "train_sequences": len(train_index), "held_out_sequences": len(eval_index),
        "trained_predictions": trained_predictions, "context_tokens": context_tokens,
        "seconds": round(elapsed, 1),
        "predictions_per_s": round(trained_predictions / max(elapsed, 1e-9), 1),
        "final_loss": curve[-1]["loss"] if curve else None,
        "held_out": held_out, "saved_dtype": str(save_dtype).removeprefix("torch."),
        "loss_curve": curve,
    }
    (out_dir / "training_report.json").write_text(json.dumps(report, indent=2))
    return report
