"""The roles a machine can take in a run, each on top of the core (hivetrain.*) and never on another role:
`coordinator` (hivetrain-coordinator, `python coordinator/start.py` in a clone), `peers` (a volunteer: hivetrain-join,
`python peers/join.py`) and `dashboard` (hivetrain-dashboard). They live inside the package so that a wheel installs
`hivetrain` alone; baselines/ and benchmarks/ are the repository's tools and need a clone."""
