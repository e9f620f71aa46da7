"""What every bench shares; its modules import nothing from ``tests``:

- ``deploy``: bring up a deployment, in this process (``LocalCluster``) or as ``pdserve up``.
- ``load``: the workload and the gRPC load generator (open loop, closed loop, fixed streams, until a time).
- ``machine``: one description of the machine a bench ran on.
- ``report``: medians, ratios, percentiles, and printing a report as JSON or lines.
- ``kernel_copy``: another version of a CPU kernel's C file, built on its own (``--against``).
- ``checkpoints``: random-weight checkpoints of named model shapes, written with transformers.
- ``watched``: a child process whose output is read on a thread and kept (its "listening" line awaited).
- ``hosts``: separate hosts on one machine (network namespaces with their own address, loopback and /dev/shm).
"""
