"""What runs in the main process, in four rooms, one job each:

- ``route``: the batch route: each batch handle from a worker taken in (its zero-copy slot
  adopted, or a slot claimed and its segment copied in), the loader's pool made once, the
  batch delivered as CPU views or on the device;
- ``epochs``: one epoch's iterator and the workers behind it: torch's worker iterator with
  pinpool's changes, the workers' index and result queues, and their shutdown (the ending
  thread);
- ``resume``: checkpoint and resume mid-epoch: what ``state_dict()`` records and how a resumed
  epoch replays it;
- ``settings``: a loader's arguments, checked once when the loader is made, and what they
  decide (the pool's settings, the arena's size, the delivery mode).

``pinpool.pinned`` (``adapter.py``, beside ``loader.py``) uses the route and the settings.

Invariants: the rooms import one another one way only, ``epochs`` the ``route`` and
``resume``, the ``route`` the ``settings``, and ``resume`` and ``settings`` no other room
(``tests/package/test_layout.py``); nothing here imports the workers' side (``_worker``).
"""
