"""llmserve.common.v1: messages shared by the public and engine APIs (generated from protos/)."""
