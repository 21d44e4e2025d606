"""The training loop of the EAGLE-3 head (CPU-friendly, float32).

Loss per training-time-test step ``k`` (weighted ``step_weight ** (k - 1)``): a mix of
cross-entropy against the target's next-token distribution restricted to the draft
vocabulary (soft) and against its argmax (hard)."""

from __future__ import annotations

import json
import math
import random
import time
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from vllm_graft.training.data import load_shards
from vllm_graft.training.eagle3 import Eagle3Head, HeadShape


def choose_draft_vocab(sequences: list[dict], size: int, vocab: int) -> torch.Tensor:
    """The ``size`` most frequent tokens of the answers (ids sorted), the head's vocab."""
    counts = Counter()
    for seq in sequences:
        counts.update(seq["tokens"][seq["mask"]].tolist())
    ids = [t for t, _ in counts.most_common(size)]
    filler = (t for t in range(vocab) if t not in counts)
    while len(ids) < min(size, vocab):
        ids.append(next(filler))
    return torch.tensor(sorted(ids), dtype=torch.long)


def _batches(sequences: list[dict], max_len: int, batch_tokens: int, seed: int):
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]["tokens"]))
    batches, current, longest = [], [], 0
    for i in order:
        length = min(len(sequences[i]["tokens"]), max_len)
        if current and max(longest, length) * (len(current) + 1) > batch_tokens:
            batches.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, length)
    if current:
        batches.append(current)
    random.Random(seed).shuffle(batches)
    return batches


def _collate(sequences, index, max_len):
    length = max(min(len(sequences[i]["tokens"]), max_len) for i in index)
    b = len(index)
    n_aux, hidden = sequences[index[0]]["aux"].shape[1:]
    tokens = torch.zeros(b, length, dtype=torch.long)
    mask = torch.zeros(b, length, dtype=torch.bool)
    valid = torch.zeros(b, length, dtype=torch.bool)
    aux = torch.zeros(b, length, n_aux, hidden)
    final = torch.zeros(b, length, hidden)
    for row, i in enumerate(index):
        seq = sequences[i]
        n = min(len(seq["tokens"]), max_len)
        tokens[row, :n] = seq["tokens"][:n]
        mask[row, :n] = seq["mask"][:n]
        valid[row, :n] = True
        aux[row, :n] = seq["aux"][:n].float()
        final[row, :n] = seq["final"][:n].float()
    return tokens, mask, valid, aux, final


def train_head(target_dir: Path, features_dir: Path, out_dir: Path, *, draft_vocab: int,
               aux_layers: tuple[int, ...], steps: int = 3, epochs: int = 2, lr: float = 5e-4,
               max_len: int = 640, batch_tokens: int = 2048, seed: int = 0,
               step_weight: float = 0.8, soft_weight: float = 0.5,
               threads: int | None = None) -> dict:
    from transformers import AutoModelForCausalLM

    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)
    target_config = json.loads((target_dir / "config.json").read_text())
    shape = HeadShape.from_target(target_config)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    embed = target.get_input_embeddings().weight.detach().clone()
    target_head = target.get_output_embeddings().weight.detach().clone()
    final_norm = target.model.norm.weight.detach().clone()
    del target

    sequences = load_shards(features_dir)
    draft_ids = choose_draft_vocab(sequences, draft_vocab, shape.vocab)
    head = Eagle3Head(shape, embed, draft_ids, aux_layers)
    with torch.no_grad():  # start from the target's own output layer and final norm
        head.lm_head.weight.copy_(target_head[draft_ids])
        head.norm.weight.copy_(final_norm)
    target_rows = target_head[draft_ids]  # target logits restricted to the draft vocab

    params = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
    plan = [b for _ in range(epochs) for b in _batches(sequences, max_len, batch_tokens, seed + _)]
    total = len(plan)
    warmup = max(1, min(50, total // 10))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda i: min(1.0, (i + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * i / total)))
    start = time.time()
    trained_tokens = 0
    history = []
    progress = tqdm(plan, desc="train head", unit="batch")
    for index in progress:
        tokens, mask, valid, aux, final = _collate(sequences, index, max_len)
        outputs = head.forward_ttt(tokens, aux, valid, steps)
        loss, parts, accuracy = 0.0, [], []
        length = tokens.shape[1]
        for k, out in enumerate(outputs, start=1):
            if length <= k:
                break
            # anchor r predicts token r + k + 1, i.e. the target's distribution at r + k
            pred = head.draft_logits(out[:, :length - k])
            label_at = final[:, k:]
            usable = mask[:, k:] & valid[:, k:]
            if not usable.any():
                continue
            with torch.no_grad():
                target_probs = (label_at[usable] @ target_rows.T).softmax(-1)
            log_probs = pred[usable].float().log_softmax(-1)
            # soft labels teach the target's distribution (sampling), the hard label its
            # greedy choice, which a flat distribution alone hardly conveys
            soft = -(target_probs * log_probs).sum(-1).mean()
            hard = F.nll_loss(log_probs, target_probs.argmax(-1))
            step_loss = soft_weight * soft + (1 - soft_weight) * hard
            loss = loss + (step_weight ** (k - 1)) * step_loss
            parts.append(float(step_loss))
            accuracy.append(float((log_probs.argmax(-1) == target_probs.argmax(-1)).float().mean()))
        if not parts:
            continue
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        trained_tokens += int(valid.sum())
        history.append({"loss": parts, "acc": accuracy})
        recent = history[-20:]
        progress.set_postfix(acc=" ".join(f"{sum(h['acc'][j] for h in recent if len(h['acc']) > j) / max(1, sum(1 for h in recent if len(h['acc']) > j)):.2f}"
                                          for j in range(steps)))
    elapsed = time.time() - start
    head.save_vllm(out_dir, target_config)
    last = history[-50:]
    report = {
        "target": target_dir.name, "draft_vocab": len(draft_ids), "steps": steps,
        "epochs": epochs, "sequences": len(sequences), "trained_tokens": trained_tokens,
        "seconds": round(elapsed, 1), "tokens_per_s": round(trained_tokens / elapsed, 1),
        "final_top1_accuracy_by_step": [
            round(sum(h["acc"][j] for h in last if len(h["acc"]) > j)
                  / max(1, sum(1 for h in last if len(h["acc"]) > j)), 3) for j in range(steps)],
    }
    (out_dir / "training_report.json").write_text(json.dumps(report, indent=2))
    return report
