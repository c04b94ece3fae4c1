"""Tests of the gRPC contracts, the generated code and the Python client."""
