"""Hand-made profiles for the simulator's, planner's and autoscaler's tests: step times chosen so the
expected figures can be worked out by hand (the profile file's format is pdserve.sizing.profile's)."""

from __future__ import annotations

from pdserve.sizing.profile import Profile, TransferProfile, WorkerProfile


def worker_profile(kind: str, prefill_per_token_s: float = 1e-4, prefill_base_s: float = 0.002,
                   decode_base_s: float = 0.004, decode_per_seq_s: float = 0.0005, decode_per_token_s: float = 0.0,
                   num_blocks: int = 4096, block_size: int = 16, max_num_seqs: int = 64,
                   max_num_batched_tokens: int | None = None) -> WorkerProfile:
    """A worker whose prompt step is ``prefill_base_s + prefill_per_token_s * N`` (no attention term) and
    whose decode step is ``decode_base_s + decode_per_seq_s * B + decode_per_token_s * B * C``."""
    tokens = [16, 64, 256, 1024]
    batches = [1, 8, 64]
    contexts = [32, 1024]
    budget = max_num_batched_tokens or (512 if kind == "prefill" else 2048)
    return WorkerProfile(
        kind=kind, role="prefill" if kind == "prefill" else "decode", cores=1, threads=1, flags=[],
        num_blocks=num_blocks, block_size=block_size, block_bytes=16384, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget, max_model_len=4096, long_prefill_token_threshold=0,
        prefill_admission="whole" if kind == "prefill" else "fill", remote_prefill_threshold=16,
        enable_prefix_caching=True, prefill_tokens=tokens,
        prefill_seconds=[prefill_base_s + prefill_per_token_s * n for n in tokens],
        prefill_cached_points=[], attention_pair_seconds=0.0, decode_batch=batches, decode_context=contexts,
        decode_seconds=[[decode_base_s + decode_per_seq_s * b + decode_per_token_s * b * c for c in contexts]
                        for b in batches])


def make_profile(transfer_s: float = 0.001, request_overhead_s: float = 0.0, **worker_kwargs) -> Profile:
    """Every worker kind alike (``worker_profile``), a transfer of ``transfer_s`` whatever its size."""
    workers = {kind: worker_profile(kind, **worker_kwargs) for kind in ("prefill", "decode", "colocated")}
    return Profile(model="hand-made", machine={"cpu": "none"}, workers=workers,
                   transfer=TransferProfile("tp1pp1", "tp1pp1", "gloo", [0, 1 << 30], [transfer_s, transfer_s]),
                   request_overhead_s=request_overhead_s)
