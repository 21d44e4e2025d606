"""Functions run inside the workers through ``LLM.collective_rpc`` (they receive the
worker as first argument), so tools work whether the engine runs in-process or not."""

from __future__ import annotations

_RECORDS: list[dict] = []


def _proposer(worker):
    runner = getattr(worker, "model_runner", None)
    drafter = getattr(runner, "drafter", None)
    if drafter is None or not hasattr(drafter, "matrix"):
        raise RuntimeError("this engine does not run Graft")
    return drafter


def save_successor_matrix(worker, path: str, metadata: dict) -> dict | None:
    """Rank 0 writes the file (tensor-parallel ranks hold bit-identical matrices), with
    the tokenizer's fingerprint added to ``metadata``."""
    from vllm_graft.vllm.successor_state import matrix_metadata

    if getattr(worker, "rank", 0) != 0:
        return None
    drafter = _proposer(worker)
    if drafter.matrix.partitions != 1:
        raise RuntimeError("saving a successor matrix needs graft.isolation 'global' "
                           "(this engine keeps one matrix per tenant or request)")
    metadata = {**matrix_metadata(worker.vllm_config), **metadata}
    size = drafter.matrix.save(path, metadata)
    return {"bytes": size, "rows": int(drafter.matrix.touched_rows().numel()),
            "memory_bytes": drafter.matrix.nbytes}


def save_successor_state(worker, reason: str) -> int | None:
    """Save ``graft.successor_state`` now (the writer rank only); the file's size in
    bytes, ``None`` where this engine keeps no state file or this rank does not write."""
    drafter = getattr(getattr(worker, "model_runner", None), "drafter", None)
    keeper = getattr(drafter, "state_keeper", None)
    return None if keeper is None else keeper.save(reason)


def request_state_counts(worker) -> dict[str, int]:
    """Per-request tables of the Graft proposer and how many requests each holds."""
    return _proposer(worker).request_state_counts()


def matrix_digest(worker) -> str:
    """SHA-256 of this rank's successor matrix (ranks must agree)."""
    import hashlib

    table = _proposer(worker).matrix.table
    return hashlib.sha256(table.cpu().numpy().tobytes()).hexdigest()


def learned_chain_acceptance(worker) -> dict:
    """What budget "auto"'s copy-chain acceptance model learned in this engine beyond
    its prior (verified and shadow chains), as a calibration's ``chain_acceptance``
    (:meth:`vllm_graft.core.budget.AcceptanceModel.learned`, in JSON form)."""
    sizer = _proposer(worker).sizer
    if sizer is None:
        raise RuntimeError("this Graft engine does not run budget \"auto\" (no chain "
                           "acceptance model)")
    return sizer.chain_acceptance.learned().model_dump(mode="json")


def start_tree_recording(worker) -> None:
    """Record every verified tree (its shape, sources, scores, drafting confidences,
    accepted rows)."""
    from vllm_graft.vllm import runner

    _proposer(worker)
    _RECORDS.clear()
    if _record not in runner.TREE_OBSERVERS:
        runner.TREE_OBSERVERS.append(_record)


def take_tree_records(worker) -> list[dict]:
    from vllm_graft.vllm import runner

    if _record in runner.TREE_OBSERVERS:
        runner.TREE_OBSERVERS.remove(_record)
    out = list(_RECORDS)
    _RECORDS.clear()
    return out


def _record(tree, accepted_rows: list[int]) -> None:
    """One verified tree. ``req_id`` (the engine's internal id: the caller's id plus a
    suffix) and ``position`` (the root's position in prompt + output) place the
    accepted tokens in the request's output, so tools can say where each token came
    from without trusting the order in which steps were recorded."""
    pending = tree.tree
    confidence = pending.confidence.tolist() if pending.confidence is not None else []
    _RECORDS.append({"req_id": tree.req_id, "position": tree.prefix_len,
                     "parents": pending.parents.tolist(),
                     "depths": pending.depths.tolist(), "source": pending.source.tolist(),
                     "score": None if pending.score is None else pending.score.tolist(),
                     "stage": pending.stage, "confidence": confidence,
                     "tokens": pending.tokens.tolist(), "accepted_rows": accepted_rows,
                     "accepted_tokens": pending.tokens[accepted_rows].tolist()})
