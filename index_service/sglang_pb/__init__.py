"""Generated protobuf modules (scripts/gen_protos.sh); not edited by hand."""
