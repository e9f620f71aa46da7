"""What prefill and decode workers share: configuration and the process's lifecycle."""
