"""The cluster simulator and its traces: the planner under synthetic load, for bench/ and tests/.

- ``cluster``: the simulated prefill and decode pools, as discrete events;
- ``simulator``: replays a trace under a scaling policy, interval by interval;
- ``traces``: seeded request traces of the standard shapes;
- ``dynamo_baseline``: a Dynamo-style planner re-implemented from its documented algorithm.

Not part of the installed package: ``bench/planner_sim.py`` and ``tests/sim`` import it from
the repository root.
"""
