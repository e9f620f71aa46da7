"""The SLO planner: observe -> forecast -> decide -> act.

- ``observer`` turns frontend stats and worker entries into an ``Observation`` per interval;
- ``forecast`` predicts the next interval's load, ``latency_model`` what a pool size and a set of
  knobs would give, from an engine ``profile`` measured by ``profiler``;
- ``planner`` decides pool sizes and knobs against the model's SLO; ``service`` runs that loop
  over etcd and acts through a ``scaling`` connector (Kubernetes, or none to only advise);
- ``observation``: ``Observation``, what the planner sees of one model an interval, as summaries;
- ``config``: ``PlannerConfig``, the planner's margins, cool-downs and step limits;
- ``deployed_knobs``: ``deployed_knobs``, the knobs in force for a model when none are stored in etcd.

Nothing in the data plane imports this package.
"""
