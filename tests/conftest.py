"""Suite-wide settings that must take effect before any test module imports torch, transformers or triton."""

import glob
import os

# No hub: every model and tokenizer in the tests comes from local files.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# Triton reads TRITON_INTERPRET when triton.language is first imported (transformers imports it early), so
# the kernels run under the interpreter on machines without an NVIDIA GPU only if it is set here, first.
if not glob.glob("/dev/nvidia[0-9]*"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
