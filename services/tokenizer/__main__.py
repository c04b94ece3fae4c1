"""`python -m services.tokenizer` / `llmserve-tokenizer`: the tokenizer service (see services.tokenizer.serving.main).

The code lives in main.py because worker processes are spawned, and a spawned child can unpickle its entry
function from an importable module but not from a package's __main__.
"""

from services.tokenizer.serving.main import main, parse_args

__all__ = ["main", "parse_args"]

if __name__ == "__main__":
    main()
