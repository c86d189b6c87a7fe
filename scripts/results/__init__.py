"""Raw benchmark results and the docs' tables rendered from them (see :mod:`.render`)."""
