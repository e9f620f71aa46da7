"""Rank groups: the processes of one worker, and the collectives between them.

A group of ``world_size = data_parallel_size * tensor_parallel_size`` ranks, one process
each. Rank ``r`` is tensor-parallel rank ``r % tp`` of data-parallel rank ``r // tp``; with
expert parallelism every rank of the group holds a share of the experts. gloo on CPU, NCCL
on GPU: the same code either way.

- ``parallel_config``: ``ParallelConfig``, a group's sizes and deadlines (msgspec only);
- ``placement``: ``GroupPlacement``, a rank's place in a group whose ranks start separately (msgspec only);
- ``errors``: ``RankFailed``, the one error a group raises when it can no longer work (standard library only);
- ``parallel_state``: ``ParallelState`` and ``SINGLE_RANK``, one rank's place in its group and its collectives;
- ``channel``: ``Channel``, a leader's ordered messages to the ranks it leads, over the group's store;
- ``rank_group``: ``RankGroup`` and ``start_group``, starting a group's ranks together and tearing them down;
- ``follower``: ``join_as_follower``, a rank started on its own joining rank 0 at the leader's address;
- ``interfaces``: which network interface holds an address (the one a group's collectives use);
- ``rank_program``: ``run_rank``, the skeleton of every child rank's program.

Import the module that holds a name: this package re-exports nothing, so that the CLI and the
operator, which need only the first two, load no torch.
"""
