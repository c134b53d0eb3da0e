"""The batch route, the main process's side: a batch handle from a worker is taken in
(``receiver``, ``intake``), lands in the loader's pool (``lazy_pool``; a split batch's pieces,
``pieces``; a zero-copy slot granted to its worker, ``grants``) and is delivered as CPU views
or on the device (``delivery``; objects the tree walk cannot look into, ``opaque``). What the
user must be told on the way is a notice (``notices``).

Invariants: a handle is taken or dropped at most once, and whatever fails on the way its
segment goes back to its worker and its unused slot back to the pool; a loader's pool is made
in one place only (``lazy_pool``); every batch leaves the route as one ``delivery.Pending``,
yielded through its ``wait()`` on the consumer's thread, where notices are given; the route
calls nothing of the epochs or of resume (the epoch's iterator calls into it, never the
reverse).
"""
