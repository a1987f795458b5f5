"""The GRPO step, the ground floor: the pure math (grpo, advantages, logprobs), batches, the memory-bounded MLX update
and the checks that run inside it (the training thread that calls it is learner/run/training_thread.py)."""
