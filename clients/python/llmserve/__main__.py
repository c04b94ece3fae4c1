"""`python -m llmserve` runs the CLI."""

import sys

from llmserve.cli import main

sys.exit(main())
