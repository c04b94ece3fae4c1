"""Generated code for the llmserve.engine proto package (see protos/llmserve/engine)."""
