"""The door: the ZeroMQ loop, its dispatch table, and what comes in (rollouts, checked) and goes out (replies, weights)."""
