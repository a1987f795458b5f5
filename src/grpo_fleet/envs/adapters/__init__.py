"""Environments written for other ecosystems, hosted as ordinary `task.env` classes (docs/environments-ecosystems.md).

- `verifiers_env`: a verifiers environment (`vf.MultiTurnEnv`, `vf.ToolEnv`, ...) loaded by its id, its rubric the
  reward; its rollout runs on `background_loop` and asks `verifiers_client` for each turn, which is ours to sample;
- `openenv_env`: an OpenEnv `Environment` (reset / step / state) in this process, its observations as user messages.

Each module imports its ecosystem's package when it is imported, so a missing extra is one line at start-up
(`pip install 'grpo-fleet[verifiers]'`, `'grpo-fleet[openenv]'`), and nothing else in grpo_fleet imports them.
"""
