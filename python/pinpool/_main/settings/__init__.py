"""A loader's settings: each argument declared and checked once (``arguments``), the pool's
arguments as one object (``pool_settings``), the arena's size (``sizing``) and the delivery
mode the arguments resolve to on this machine (``delivery_mode``).

Invariants: the arguments are checked when the loader (or ``pinpool.pinned``) is made, not at
the first batch; the arena's size is decided once, when the pool is made; what comes out is
frozen and passed down whole; nothing here imports another room of ``_main``.
"""
