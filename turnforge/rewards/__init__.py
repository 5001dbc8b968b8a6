"""Rewards beyond the env's own: generative (judge) rewards (``turnforge.rewards.judge``)."""
