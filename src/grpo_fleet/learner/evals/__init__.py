"""Evaluation while training: eval rounds leased to actors, or run on the learner when none takes them."""
