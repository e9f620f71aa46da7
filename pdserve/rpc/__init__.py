"""What every pdserve gRPC server and client shares: server set-up, wire conversions."""
