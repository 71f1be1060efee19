"""Build: generated C -> a cffi extension in a content-addressed, hash-verified cache."""
from .cache import (BuildError, CompilerNotFoundError, Library, atomic_write_text, build,
                    cache_dir, cache_entries)

__all__ = ["BuildError", "CompilerNotFoundError", "Library", "atomic_write_text", "build",
           "cache_dir", "cache_entries"]
