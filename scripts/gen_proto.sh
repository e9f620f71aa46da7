#!/usr/bin/env bash
# Regenerate the Python code of proto/pdserve/v1/*.proto into pdserve/v1/ (committed).
# tests/test_proto.py fails when the committed code is stale; run this after editing a .proto.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
OUT="${1:-.}"
"$PYTHON" -m grpc_tools.protoc -Iproto --python_out="$OUT" --pyi_out="$OUT" --grpc_python_out="$OUT" proto/pdserve/v1/*.proto
