"""``python -m mari_eval.judge serve``: the embedded judge until interrupted (``server.main``)."""

from mari_eval.judge.server import main

if __name__ == "__main__":
    main()
