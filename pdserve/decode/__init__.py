"""The decode worker: pulls a prompt's KV over NIXL (or computes it) and streams the tokens."""
