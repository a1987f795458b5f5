"""What the run keeps: the shared state record, checkpoints, the append-only logs, samples and trackers."""
