"""Pieces both services share: typed errors and gRPC server plumbing (health, reflection, error mapping)."""
