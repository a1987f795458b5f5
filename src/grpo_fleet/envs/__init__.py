"""Episodes: multi-turn environments and tools, token in and token out.

- `protocol`: the environment interface (skyrl-gym's init/step) and the checks on what user code returns
  (`task.env = "my_env.py:ClassName"` is found, digested and loaded by tasks/env_module.py, like a reward module);
- `hosting`: the live environments of the episodes in progress, each call under a timeout;
- `process`: that host in a child process of the actor, beside the rewards' (restarted when it dies or hangs);
- `template`: observation tokens from the chat template's difference between turns;
- `runner`: the actor's episode runner (G episodes per prompt, one continuous batch, sampled/environment mask);
- `tools`: the ready-made `<tool_call>` convention;
- `capital_quiz`: a shipped environment (feedback and a second try);
- `adapters/`: environments written for verifiers and OpenEnv, hosted as `task.env` classes.
"""
