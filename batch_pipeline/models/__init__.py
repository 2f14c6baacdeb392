"""Models: the built-in catalog and its conversion cache, and checkpoints synced from an object store."""
