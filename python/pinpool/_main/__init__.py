"""What runs in the main process: receiving batches (adopt a zero-copy slot, or check one
out and copy the segment in), handing out zero-copy slots, and delivering batches as CPU
views or on the device; and ``adapter``, which pins the batches of a loader pinpool does not
own through a receiver of its own."""
