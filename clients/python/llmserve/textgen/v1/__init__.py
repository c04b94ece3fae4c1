"""llmserve.textgen.v1: the public text-generation API (generated from protos/)."""
