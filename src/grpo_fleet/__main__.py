"""`python -m grpo_fleet` is the same as the `grpo-fleet` command."""

import sys

from grpo_fleet.cli.main import main

sys.exit(main())
