"""Generated protobuf and gRPC code of ``proto/pdserve/v1`` (``scripts/gen_proto.sh``; do not edit)."""
