"""Status details with a meaning across processes."""

# A worker that refuses a request because it drains starts its details with this: nothing was
# started there, so the frontend may send the request to another worker.
DRAINING = "draining: "
