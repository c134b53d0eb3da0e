"""Entry point of ``python -m pinpool.bench`` (see :mod:`pinpool.bench`)."""

from .runner import main

if __name__ == "__main__":  # (a forkserver imports this module as __mp_main__: not a run)
    raise SystemExit(main())
