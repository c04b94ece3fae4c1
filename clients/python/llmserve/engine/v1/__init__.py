"""llmserve.engine.v1: the internal engine API (generated from protos/)."""
