"""Generated code for the llmserve.textgen proto package (see protos/llmserve/textgen)."""
