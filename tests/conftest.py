"""Shared fixtures: `procs` starts real appliance processes (see tests/procs.py)."""

from procs import procs  # noqa: F401  (fixture)
