"""Watching a run: Prometheus metrics and their HTTP server, training-curve plots, the samples viewer."""
