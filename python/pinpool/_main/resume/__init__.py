"""Checkpoint and resume mid-epoch: a loader's state built and a loaded one applied
(``checkpoint``, whose doc tells the whole mechanism), the saved state's format and checks
(``state``), and one epoch's record and the sampler that replays it (``epoch``).

Invariants: a state is plain data, ``torch.save``-able; a loaded state is checked whole before
anything reads it, and a mid-epoch state resumes at the next unseen sample or is refused,
never at another sample; nothing here imports another room of ``_main``: the loader and the
epoch's iterator call in.
"""
