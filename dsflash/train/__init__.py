"""Train a small V4.1-architecture model + DSpark draft on CPython's documentation (see docs/training.md)."""
