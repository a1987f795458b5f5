"""The fleet as the learner sees it: actors, their bans, how many leases each gets, which prompts are out."""
