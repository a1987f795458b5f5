"""What judges actors: the learner checks what each actor reports against what it can compute itself.

An actor is a machine the learner does not control. Besides tokens it reports
rewards and logprobs, and both can be checked: the learner holds every prompt's
answer and the weights of every version still trainable. This folder is that
judgement, built once per run (`verification.Verification`, the one interface
intake and the training thread use):

- **Rewards, re-scored** (`actor_checks.RewardCheck`): every submitted group,
  from its completion tokens, by the learner's own reward in a child process;
  a deterministic environment's episodes are replayed there with the actions
  they report (`env_replay`). When: as the Rollouts arrive, on the one
  verifier thread (`verifier_thread`), outside the run's lock, so a slow reward
  never holds the request loop; intake reads the verdicts under the lock.
  Cost of a failure: the group is refused (`reward_mismatch`,
  `env_replay_mismatch`, or `reward_timeout`/`env_replay_timeout` when the
  actor's work ran the check out of time), its prompt goes to another actor,
  and the actor is charged a violation (banned after server.max_violations).
  A check that could not finish for the learner's own reasons
  (`reward_unverifiable`) re-queues the prompt and charges nothing.
- **Who is checked** (`trust`): at intake, under the lock, each informative
  group gets its actor dtype's honest bound and a flag: every group of a key on
  probation, a random share (security.check_share, the OS's randomness) after.
  A Hello or a violation starts probation again (learner/actors/registry.py).
- **The honest bound, calibrated** (`gap_calibration`): a half-precision
  actor's gap is held to a bound measured on this run's model, once, by the
  training thread as it starts (intake waits for it only if a group comes back
  first); a float32 pair keeps its fixed bound (learner/step/gap_bounds.py).
- **Logprobs, against the claimed version** (`actor_checks.LogprobCheck`,
  `actor_checks.WeightHistory`): on the training thread, per optimizer batch,
  in one call (`batch_checks.BatchChecks.train`, around the step), the check
  plan (`batch_checks`) sends each group one way: fused into the
  step's own forward (its version is the one the step trains from), recomputed
  at its version before the step (flagged, or from a key banned before), or
  unchecked with a counted reason; older groups are also screened inside the
  step. Cost of a failure: the actor is banned at once, every group of it
  dropped (the batch's included), its leases released; the rest of the batch
  goes back untrained, so a lie never trains. A pass earns trust.

The in-step math stays on the ground floor (learner/step/: fused_check,
recheck, gap_bounds), where the layers rule keeps it. This floor sits under the
door and the fleet, which call it, and over ranks/, records/ and step/
(tests/unit/test_layering.py).
"""
