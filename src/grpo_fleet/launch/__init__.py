"""`grpo-fleet launch` and `grpo-fleet demo`: the fleet file, the launcher's policy and processes, a fleet on this machine."""
