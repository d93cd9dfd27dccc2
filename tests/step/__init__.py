"""Tests of the step core every wrapper shares: the finiteness check, the
overflow record, unscaling, apply-or-skip, the failure policy and the state
check, and the refusal of bad step inputs."""
