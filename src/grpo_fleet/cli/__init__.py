"""The `grpo-fleet` command line (main.py), its tools around a run (tools.py), and the docs' generated references."""
