"""The foundation every layer may read: the settings, and file IO (local or fsspec, atomic, beneath a root)."""
