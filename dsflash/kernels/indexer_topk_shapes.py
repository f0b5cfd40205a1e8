"""Input shape checks of the indexer top-k (and what the paged Triton scorer reads), shared by the reference (``indexer_topk``) and the Triton file
(``indexer_topk_triton``), so that the Triton file never imports the module that dispatches to it."""
from __future__ import annotations


def check_inputs(q, w, k, visible, valid, cand):
    if q.ndim != 4:
        raise ValueError(f"q must be [B, S, Hi, Di], got {q.shape}")
    B, S, Hi, Di = q.shape
    if w.shape != (B, S, Hi):
        raise ValueError(f"w must be [B={B}, S={S}, Hi={Hi}], got {w.shape}")
    if k.ndim != 3 or k.shape[0] != B or k.shape[2] != Di:
        raise ValueError(f"k must be [B={B}, T, Di={Di}], got {k.shape}")
    if visible.shape != (B, S) or valid.shape != (B, S):
        raise ValueError(f"visible and valid must be [B={B}, S={S}], got {visible.shape}, {valid.shape}")
    if cand is not None and cand.shape != (B, S, k.shape[1]):
        raise ValueError(f"cand must be [B={B}, S={S}, T={k.shape[1]}], got {cand.shape}")


def paged_supports(q, pool) -> bool:
    """The pool layouts and shapes ``indexer_paged_triton`` reads: bf16 queries with power-of-two heads (padded
    to 16 in the kernel) and head dim (>= 32) over MXFP4 codes + UE8M0 scales ("q", "s") or a plain "x" pool."""
    B, S, Hi, Di = q.shape
    if str(q.dtype) != "bfloat16" or Hi & (Hi - 1) or Di & (Di - 1) or Di < 32:
        return False
    if set(pool) == {"q", "s"}:
        return pool["q"].shape[-1] * 2 == Di and pool["s"].shape[-1] * 32 == Di
    return set(pool) == {"x"} and pool["x"].shape[-1] == Di
