"""What a grpo-fleet command's exit status means, and which of an actor's exits no restart can cure.

`grpo-fleet launch` (and a service manager set up like deploy/systemd) restarts
an actor after a transient exit and stops it for good after a permanent one:
a permanent refusal fails the same way on every start.
"""

from __future__ import annotations

DONE = 0  # the run is over (the learner said Shutdown), or the process was asked to stop
FAILED = 1  # a crash (an uncaught exception): transient, worth a restart
# Permanent: a configuration error, a reward file or model copy that differs from the learner's (digest
# mismatch), a reward the actor does not have, bad CURVE keys, a protocol version other than the learner's.
REFUSED = 2
# What a POSIX shell on the actor's host answers when the command cannot run at all (a wrong
# `grpo_fleet` path in the fleet file): permanent too. ssh's own failures (255) are transient.
# A data-parallel learner rank lost a peer, or a collective outlived distributed.timeout_seconds
# (learner/ranks/collectives.py): no checkpoint was written; resume the run from rank 0's last one.
RANKS_FAILED = 3
NOT_EXECUTABLE = 126
NOT_FOUND = 127
PERMANENT = frozenset({REFUSED, NOT_EXECUTABLE, NOT_FOUND})


def is_permanent(code: int) -> bool:
    """True when restarting the process would only fail the same way again."""
    return code in PERMANENT
