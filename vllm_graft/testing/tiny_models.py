"""Tiny random models that vLLM loads like real ones, built locally in seconds.

* :func:`build_tokenizer`: a byte-level BPE trained on Python's standard library.
* :func:`build_target`: a random Qwen3 target. ``sharpness`` scales the output layer
  so the next-token distribution is peaked, which makes sampling tests sensitive.
* :func:`build_eagle3_head`: a random EAGLE-3 head in the layout vLLM's
  ``LlamaForCausalLMEagle3`` loads (``fc``, ``midlayer.*``, ``norm``, ``lm_head``,
  ``d2t``/``t2d`` for a reduced draft vocabulary).
* :func:`build_speculators_eagle3_head`: the same head in the speculators format public
  EAGLE-3 heads are published in (``speculators_config``, ``transformer_layer_config``).
"""

from __future__ import annotations

import glob
import json
import os
import sysconfig
from pathlib import Path

import torch

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build_tokenizer(out_dir: str | os.PathLike, vocab_size: int = 2048, files: int = 60):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    sources = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))[:files]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.train(sources, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>",
                                     eos_token="<|im_end|>", pad_token="<pad>",
                                     model_max_length=4096)
    hf_tok.chat_template = CHAT_TEMPLATE
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    hf_tok.save_pretrained(out_dir)
    return hf_tok


def build_target(out_dir: str | os.PathLike, *, hidden: int = 128, layers: int = 4,
                 heads: int = 4, kv_heads: int = 2, head_dim: int = 64,
                 intermediate: int = 384, sharpness: float = 1.0, seed: int = 0,
                 vocab_size: int = 2048, initializer_range: float = 0.02) -> Path:
    """Tokenizer + random Qwen3 in ``out_dir`` (fp32 weights). A larger
    ``initializer_range`` gives less repetitive greedy continuations."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    out = Path(out_dir)
    tok = build_tokenizer(out, vocab_size=vocab_size)
    cfg = Qwen3Config(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=head_dim, max_position_embeddings=4096, rope_theta=10000.0,
        tie_word_embeddings=False, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, torch_dtype="float32",
        initializer_range=initializer_range)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpness)
    model.save_pretrained(out, safe_serialization=True)
    model.generation_config.save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    config.setdefault("rope_theta", 10000.0)
    config["torch_dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def build_eagle3_head(target_dir: str | os.PathLike, out_dir: str | os.PathLike, *,
                      draft_ids: list[int] | None = None, seed: int = 1,
                      scale: float = 0.02) -> Path:
    """Random EAGLE-3 head for ``target_dir``; ``draft_ids`` = the reduced draft vocab
    (target ids), default the first half of the vocabulary."""
    t, layer, ids, aux, weights = _eagle3_head_parts(target_dir, draft_ids, seed, scale)
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], **layer,
           "draft_vocab_size": len(ids), "target_hidden_size": t["hidden_size"],
           "torch_dtype": "float32", "bos_token_id": t["bos_token_id"],
           "eos_token_id": t["eos_token_id"],
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux,
                            "use_aux_hidden_state": True}}
    return _save_head(out_dir, cfg, weights)


def build_speculators_eagle3_head(target_dir: str | os.PathLike,
                                  out_dir: str | os.PathLike, *,
                                  draft_ids: list[int] | None = None, seed: int = 1,
                                  scale: float = 0.02, speculative_tokens: int = 3,
                                  speculators_model_type: str = "eagle3") -> Path:
    """The head :func:`build_eagle3_head` writes (same seed, same weights), saved in the
    speculators format public EAGLE-3 heads ship in: ``speculators_model_type``, the
    decoder layer's settings in ``transformer_layer_config``, the verifier and proposal
    methods in ``speculators_config``; weights under ``layers.0.*`` with the verifier's
    ``embed_tokens`` beside them. ``speculators_model_type`` other than ``eagle3``
    writes a malformed head, for tests."""
    from safetensors.torch import load_file

    t, layer, ids, aux, weights = _eagle3_head_parts(target_dir, draft_ids, seed, scale)
    weights = {name.replace("midlayer.", "layers.0."): value
               for name, value in weights.items()}
    target_weights = load_file(Path(target_dir) / "model.safetensors")
    weights["embed_tokens.weight"] = target_weights["model.embed_tokens.weight"]
    cfg = {"architectures": ["Eagle3Speculator"],
           "speculators_model_type": speculators_model_type,
           "speculators_version": "0.3.0",
           "speculators_config": {
               "algorithm": "eagle3", "default_proposal_method": "greedy",
               "proposal_methods": [{"proposal_type": "greedy", "accept_tolerance": 0.0,
                                     "speculative_tokens": speculative_tokens,
                                     "verifier_accept_k": 1}],
               "verifier": {"name_or_path": str(target_dir),
                            "architectures": t["architectures"]}},
           "transformer_layer_config": {**layer, "attention_bias": False,
                                        "mlp_bias": False},
           "draft_vocab_size": len(ids), "norm_before_residual": False,
           "target_hidden_size": None, "eagle_aux_hidden_state_layer_ids": aux,
           "torch_dtype": "float32"}
    return _save_head(out_dir, cfg, weights)


def _eagle3_head_parts(target_dir, draft_ids, seed, scale):
    """(target config, decoder-layer config, draft ids, aux layer ids, weights) of the
    random EAGLE-3 head both head writers save, weights named as vLLM's
    ``LlamaForCausalLMEagle3`` loads them."""
    t = json.loads((Path(target_dir) / "config.json").read_text())
    hidden, vocab, inter = t["hidden_size"], t["vocab_size"], t["intermediate_size"]
    heads, kv_heads, head_dim = t["num_attention_heads"], t["num_key_value_heads"], t["head_dim"]
    layers = t["num_hidden_layers"]
    ids = draft_ids if draft_ids is not None else list(range(vocab // 2))
    aux = [1, layers // 2, layers - 1]
    layer = {"model_type": "llama", "hidden_size": hidden, "intermediate_size": inter,
             "num_attention_heads": heads, "num_key_value_heads": kv_heads,
             "head_dim": head_dim, "num_hidden_layers": 1, "vocab_size": vocab,
             "rms_norm_eps": 1e-6, "max_position_embeddings": t["max_position_embeddings"],
             "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False}
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return (torch.randn(*shape, generator=g) * scale).float()

    weights = {
        "fc.weight": rand(hidden, 3 * hidden),
        "midlayer.input_layernorm.weight": torch.ones(hidden),
        "midlayer.hidden_norm.weight": torch.ones(hidden),
        "midlayer.post_attention_layernorm.weight": torch.ones(hidden),
        "midlayer.self_attn.q_proj.weight": rand(heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": rand(hidden, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": rand(inter, hidden),
        "midlayer.mlp.up_proj.weight": rand(inter, hidden),
        "midlayer.mlp.down_proj.weight": rand(hidden, inter),
        "norm.weight": torch.ones(hidden),
        "lm_head.weight": rand(len(ids), hidden),
        "d2t": torch.tensor([tid - i for i, tid in enumerate(ids)], dtype=torch.long),
        "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill_(0, torch.tensor(ids), True),
    }
    return t, layer, ids, aux, weights


def _save_head(out_dir, cfg: dict, weights: dict) -> Path:
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def build_dflash_drafter(target_dir: str | os.PathLike, out_dir: str | os.PathLike, *,
                         layers: int = 1, seed: int = 2, scale: float = 0.02) -> Path:
    """Random DFlash block drafter for ``target_dir``, in the layout vLLM's
    ``DFlashQwen3ForCausalLM`` loads (``DFlashDraftModel``: Qwen3 decoder layers over
    the target's fused hidden states, ``fc`` + ``hidden_norm``; embeddings and LM head
    shared with the target). Its layers attend causally (``dflash_config.causal``), the
    attention vLLM's CPU backend provides; the mask token is the tokenizer's pad."""
    t = json.loads((Path(target_dir) / "config.json").read_text())
    hidden, vocab, inter = t["hidden_size"], t["vocab_size"], t["intermediate_size"]
    heads, kv_heads, head_dim = t["num_attention_heads"], t["num_key_value_heads"], t["head_dim"]
    target_layers = t["num_hidden_layers"]
    aux = [0, target_layers // 2 - 1, target_layers - 2]  # DFlash ids: vLLM adds 1
    cfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3",
           "hidden_size": hidden, "intermediate_size": inter, "num_attention_heads": heads,
           "num_key_value_heads": kv_heads, "head_dim": head_dim, "num_hidden_layers": layers,
           "vocab_size": vocab, "rms_norm_eps": 1e-6,
           "max_position_embeddings": t["max_position_embeddings"], "rope_theta": 10000.0,
           "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "float32",
           "bos_token_id": t["bos_token_id"], "eos_token_id": t["eos_token_id"],
           "num_target_layers": target_layers,
           "dflash_config": {"mask_token_id": t["pad_token_id"], "target_layer_ids": aux,
                             "causal": True}}
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return (torch.randn(*shape, generator=g) * scale).float()

    weights = {"fc.weight": rand(hidden, len(aux) * hidden),
               "hidden_norm.weight": torch.ones(hidden), "norm.weight": torch.ones(hidden)}
    for i in range(layers):
        p = f"layers.{i}."
        weights.update({
            p + "input_layernorm.weight": torch.ones(hidden),
            p + "post_attention_layernorm.weight": torch.ones(hidden),
            p + "self_attn.q_proj.weight": rand(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
            p + "self_attn.q_norm.weight": torch.ones(head_dim),
            p + "self_attn.k_norm.weight": torch.ones(head_dim),
            p + "mlp.gate_proj.weight": rand(inter, hidden),
            p + "mlp.up_proj.weight": rand(inter, hidden),
            p + "mlp.down_proj.weight": rand(hidden, inter),
        })
    return _save_head(out_dir, cfg, weights)
