#!/usr/bin/env bash
# Regenerate the protobuf modules kvidx checks in (grpcio-tools from the test extras):
#   schemas/proto/kv_indexer.proto -> index_service/sglang_pb/kv_indexer_pb2.py
# tests/unit/index_service/test_sglang_indexer.py fails when the checked-in module is not what this makes.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-index_service/sglang_pb}"
mkdir -p "$out"
.venv/bin/python -m grpc_tools.protoc -I schemas/proto --python_out="$out" \
  schemas/proto/kv_indexer.proto
