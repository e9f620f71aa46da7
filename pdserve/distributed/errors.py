"""The one error a rank group raises when it can no longer work."""


class RankFailed(RuntimeError):
    """A rank of the group died, or a collective took past the group's timeout: the group is
    finished, and its owner tears it down (a worker's supervisor then restarts it)."""
