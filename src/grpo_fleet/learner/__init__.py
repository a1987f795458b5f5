"""Learner side, in floors (top to bottom): run/ (builds a learner from a RunConfig and runs its two threads), evals/
(evaluation rounds), door/ (the ZeroMQ loop and what comes in and goes out), actors/ (the registry, bans, leases),
verify/ (what judges actors), ranks/ (data-parallel), records/ (state, checkpoints, logs), step/ (the GRPO math and
the MLX update)."""
