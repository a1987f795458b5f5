"""Learner side: the GRPO objective, the optimizer step and weight publishing."""
