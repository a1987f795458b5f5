"""Message builders shared by the unit and integration tests (tests/ is on sys.path through its conftest)."""

from __future__ import annotations

from grpo_fleet.protocol import Lease, PromptItem, Tensor


def bulky(n_bytes: int) -> Lease:
    """A message carrying `n_bytes` of tensor data (n_bytes a multiple of 4)."""
    tensor = Tensor(dtype="int32", shape=[n_bytes // 4], data=bytes(range(256)) * (n_bytes // 256) + b"\x00" * (n_bytes % 256))
    prompt = PromptItem(group_id="g", prompt_index=0, prompt_tokens=tensor, fields={})
    return Lease(lease_id="L", deadline_seconds=1.0, policy_version=0, prompts=[prompt])
