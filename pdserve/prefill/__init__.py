"""The prefill worker: computes a prompt's KV and first token, and holds the blocks for the pull."""
