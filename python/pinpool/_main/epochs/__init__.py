"""Epochs and workers: one epoch's iterator (``loader_iter``) over torch's multi-process
iterator with pinpool's changes (``workers``), the workers' index queues written from Rust
(``index_queue``), their result queue read whole (``results``), and the workers' shutdown: its
steps (``shutdown``) and the thread that runs them (``ending_thread``).

Invariants: every batch yielded is counted in its epoch before ``next()`` returns; once a
shutdown returns, every worker of the iterator has exited and been reaped and its queues are
closed, whatever a signal handler raised meanwhile; ``ending_thread`` imports nothing that
imports torch, so that ``import pinpool`` (which imports it for ``wait_for_freed_pools``) needs
no torch; the shutdown modules never import ``workers``: the iterator calls them, never the
other way round.
"""
