"""``pdserve up``: start and supervise a whole deployment on one machine.

- ``up``: what ``pdserve up`` runs: checks, the cluster, the optional planner, supervision.
- ``local_cluster``: the registry (a given etcd, or its own ``etcd_process``), the frontend and the
  worker processes, started together and stopped together.
- ``certificates``: the CA and per-component certificates ``up`` makes for its deployment.
- ``deployment_record``: the running deployment, recorded for the ``pdserve`` commands beside it.
- ``local_connector``: the planner's scaling connector that resizes those local pools.
- ``child``: ``Child``, one child process (a ``python -m pdserve ...`` server), started (again) and stopped.
- ``supervisor``: ``Supervisor``, which restarts a child that dies, with back-off (``RestartPolicy``), up
  to a limit.
"""
