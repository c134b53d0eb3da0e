"""The wire between a DataLoader worker and the main process: the one batch handle, the leaf
specs and their checks, the tree walker, and how each side reaches the other's shared memory.
Imported by both sides; imports neither."""
