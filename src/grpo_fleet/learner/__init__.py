"""Learner side, in rooms: step/ (the GRPO math and the MLX update), door/ (the ZeroMQ loop and what comes in and goes
out), fleet/ (actors, bans, leases), records/ (state, checkpoints, logs), evals/ (evaluation rounds), ranks/
(data-parallel), and setup.py, which builds a learner from a RunConfig."""
