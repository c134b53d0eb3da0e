"""Entry point of ``python -m pinpool.bench`` (see :mod:`pinpool.bench`)."""

from .runner import main

raise SystemExit(main())
