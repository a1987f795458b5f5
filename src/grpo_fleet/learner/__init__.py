"""Learner side: intake, leases and the actor registry, the GRPO step, snapshots, checkpoints, and the loop serving them."""
