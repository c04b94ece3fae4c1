"""`python -m services.engine`: the engine service (see services.engine.serving.main)."""

from services.engine.serving.main import main

if __name__ == "__main__":
    main()
