"""The methods the benchmark compares, as speculative configs for one vLLM engine."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_graft.core.config import PAPER_BUDGET


@dataclass(frozen=True)
class Method:
    name: str
    kind: str  # plain | vllm | graft
    spec: dict | None = None
    graft: dict = field(default_factory=dict)
    uses_retrieval: bool = False
    note: str = ""
    #: its engine proposes the text of the requests it served to later ones (suffix
    #: decoding's tree of responses; one matrix and the outputs shared by every request):
    #: a sweep's later rounds of the same prompts would meet what it memorised, so each
    #: round starts it afresh
    remembers_requests: bool = False

    def speculative_config(self, head: str, warmup: str | None, calibration: str | None,
                           drafter: str = "eagle3",
                           tail_calibration: str | None = None, dflash: str | None = None,
                           dflash_calibration: str | None = None) -> dict | None:
        """``head``: the EAGLE-3 head, or the draft model when ``drafter`` is
        ``draft_model`` (vLLM's chain then uses the draft model too). ``calibration``
        serves the tree variants, ``tail_calibration`` (a chain calibration) the
        Graft-TAIL ones. The DFlash methods use ``dflash`` (a block drafter) instead of
        ``head``, and ``dflash_calibration`` (a chain calibration of its blocks)."""
        if self.kind == "plain":
            return None
        if self.kind == "vllm":
            spec = dict(self.spec)
            if spec.get("model") == "DFLASH":
                spec["model"] = dflash
            elif spec.get("model") == "HEAD":
                spec["model"] = head
                if drafter == "draft_model":
                    spec["method"] = "draft_model"
            return spec
        graft = dict(self.graft)
        if graft.get("drafter") == "dflash":
            head, tail_calibration = dflash, dflash_calibration
        elif drafter != "eagle3":
            graft["drafter"] = drafter
        if self.uses_retrieval and warmup and "warmup" not in graft:
            graft["warmup"] = warmup
        variant = graft.get("variant", "graft")
        if variant == "tail":
            calibration = tail_calibration
        if calibration and variant in ("graft", "prune_only", "tail") \
                and "thresholds" not in graft:
            graft["calibration"] = calibration
        return {"method": "graft", "model": head, "graft": graft}


def _auto(budget: int) -> dict:
    """Budget "auto" capped at the sweep's ``budget``: the calibration the bench fits at
    that budget fits these rows too ("auto" alone is a cap of 60, and a calibration of
    another budget stops the engine at start-up)."""
    return {"budget": "auto"} if budget == PAPER_BUDGET else {"budget": budget,
                                                              "auto_size": True}


def _one_mode(name: str, mode: str, note: str, budget: int) -> Method:
    """Budget "auto" with the throughput guard held to one mode."""
    return Method(name, "graft", graft={"variant": "graft", **_auto(budget),
                                        "guard_modes": [mode]},
                  uses_retrieval=mode != "plain", note=note)


def methods(budget: int, chain_tokens: int = 5, dflash_block: int = 8) -> dict[str, Method]:
    return {
        "plain": Method("plain", "plain", note="no speculation"),
        "plain_again": Method("plain_again", "plain",
                              note="diagnostic: a second plain engine, the same config in a "
                                   "process of its own (the sweep's A/A control: how far "
                                   "from 1.0x plain its noise alone reaches)"),
        "eagle3": Method("eagle3", "vllm", {"method": "eagle3", "model": "HEAD",
                                            "num_speculative_tokens": chain_tokens},
                         note=f"vLLM's EAGLE-3 chain (or draft-model chain), "
                              f"{chain_tokens} tokens"),
        "ngram": Method("ngram", "vllm", {"method": "ngram", "prompt_lookup_max": 4,
                                          "prompt_lookup_min": 2,
                                          "num_speculative_tokens": chain_tokens},
                        note="vLLM's prompt lookup"),
        "ngram_long": Method("ngram_long", "vllm", {"method": "ngram", "prompt_lookup_max": 5,
                                                    "prompt_lookup_min": 3,
                                                    "num_speculative_tokens": chain_tokens * 2},
                             note=f"vLLM's prompt lookup for copies: matches of 3-5 tokens, "
                                  f"{chain_tokens * 2} tokens"),
        "suffix": Method("suffix", "vllm", {"method": "suffix",
                                            "num_speculative_tokens": chain_tokens * 4},
                         note="vLLM's suffix decoding (arctic-inference)",
                         remembers_requests=True),
        "dense_tree": Method("dense_tree", "graft", graft={"variant": "dense_tree",
                                                           "budget": budget},
                             note="EAGLE-3 dynamic tree"),
        "prune_only": Method("prune_only", "graft", graft={"variant": "prune_only",
                                                           "budget": budget},
                             note="calibrated pruning without retrieval (ECHO-like)"),
        "retrieval_only": Method("retrieval_only", "graft",
                                 graft={"variant": "retrieval_only", "budget": budget},
                                 uses_retrieval=True, note="Token-Recycling-like"),
        "graft": Method("graft", "graft", graft={"variant": "graft", "budget": budget},
                        uses_retrieval=True,
                        note="pruning + matrix retrieval + context copies (the default)"),
        "graft_reference_ops": Method(
            "graft_reference_ops", "graft",
            graft={"variant": "graft", "budget": budget, "ops_backend": "reference"},
            uses_retrieval=True,
            note="diagnostic: the graft method on the plain torch path the fused step ops "
                 "are tested against (what the fused ops save on this machine)"),
        "graft_no_context": Method("graft_no_context", "graft",
                                   graft={"variant": "graft", "budget": budget,
                                          "context": False},
                                   uses_retrieval=True,
                                   note="pruning + matrix retrieval, no context copies"),
        "graft_auto": Method("graft_auto", "graft", graft={"variant": "graft",
                                                           **_auto(budget)},
                             uses_retrieval=True,
                             note="budget \"auto\": each step a sized tree, a copy chain "
                                  "or plain decoding, whichever measures fastest"),
        "graft_auto_shared": Method(
            "graft_auto_shared", "graft",
            graft={"variant": "graft", **_auto(budget), "isolation": "global"},
            uses_retrieval=True,
            note="budget \"auto\" with every request sharing one matrix and copying from "
                 "each other's outputs (isolation global), as suffix decoding shares its "
                 "tree; the default keeps a request that names no tenant private",
            remembers_requests=True),
        "tail": Method("tail", "graft", graft={"variant": "tail", "budget": chain_tokens},
                       uses_retrieval=True,
                       note=f"Graft-TAIL: EAGLE-3 chain, unsure tail from the matrix, "
                            f"{chain_tokens} tokens"),
        "tail_auto": Method("tail_auto", "graft",
                            graft={"variant": "tail", "budget": chain_tokens,
                                   "auto_size": True},
                            uses_retrieval=True,
                            note=f"Graft-TAIL sized per step ({chain_tokens} tokens as a "
                                 f"cap) with the throughput guard on"),
        "dflash": Method("dflash", "vllm", {"method": "dflash", "model": "DFLASH",
                                            "num_speculative_tokens": dflash_block},
                         note=f"vLLM's DFlash block drafter, blocks of {dflash_block} "
                              f"tokens"),
        "tail_dflash": Method("tail_dflash", "graft",
                              graft={"variant": "tail", "drafter": "dflash",
                                     "budget": dflash_block},
                              uses_retrieval=True,
                              note=f"Graft-TAIL on the DFlash drafter: the block's "
                                   f"confident prefix, the matrix's walk after it, "
                                   f"{dflash_block} tokens"),
        "graft_plain": _one_mode("graft_plain", "plain",
                                 "diagnostic: Graft's runner with every step decoded "
                                 "plainly (its fixed cost against plain)", budget),
        "graft_chain": _one_mode("graft_chain", "chain",
                                 "copy chains only: context copies continued by the "
                                 "successor matrix, no drafter", budget),
        "graft_chain_shared": Method(
            "graft_chain_shared", "graft",
            graft={"variant": "graft", **_auto(budget), "guard_modes": ["chain"],
                   "isolation": "global"},
            uses_retrieval=True,
            note="diagnostic: copy chains only, every request copying from the others' "
                 "outputs (isolation global)",
            remembers_requests=True),
        "graft_tree": _one_mode("graft_tree", "tree",
                                "diagnostic: a hybrid tree every step, sized by budget "
                                "\"auto\" (its tree mode alone)", budget),
    }
