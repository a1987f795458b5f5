"""The GRPO step: the pure math (grpo, logprobs), batches, the memory-bounded MLX update and the training thread."""
