"""Generated code for the llmserve.common proto package (see protos/llmserve/common)."""
