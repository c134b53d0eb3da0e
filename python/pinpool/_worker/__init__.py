"""What runs in DataLoader worker processes: pinpool's collate, the one choice of where a
batch goes (its zero-copy slot, else a segment), streaming collation and heap tuning."""
