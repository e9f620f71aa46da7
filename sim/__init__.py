"""The cluster simulator and its traces: the planner under synthetic load, for bench/ and tests/.

Not part of the installed package: ``bench/planner_sim.py`` and ``tests/sim`` import it from
the repository root.
"""
