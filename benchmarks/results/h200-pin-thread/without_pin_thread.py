"""Runs ``python -m pinpool.bench`` with every pinpool.DataLoader made without torch's pin
thread (``pin_memory`` set False after construction): the consumer's thread then takes each
batch from the workers' result queue itself. An experiment for #27 item 4 (call 8)."""

import runpy

import pinpool.loader

_init = pinpool.loader.DataLoader.__init__


def _without_pin_thread(self, *args, **kwargs):  # type: ignore[no-untyped-def]
    _init(self, *args, **kwargs)
    self.pin_memory = False


pinpool.loader.DataLoader.__init__ = _without_pin_thread  # type: ignore[method-assign]
runpy.run_module("pinpool.bench", run_name="__main__", alter_sys=True)
