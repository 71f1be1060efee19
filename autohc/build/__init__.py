"""Build: generated C -> a cffi extension in a content-addressed, hash-verified cache."""
from .cache import (EMULATED_TILE_FLAGS, BuildError, CompilerNotFoundError, Library, atomic_write_text,
                    build, cache_dir, cache_entries, unwritable)

__all__ = ["EMULATED_TILE_FLAGS", "BuildError", "CompilerNotFoundError", "Library", "atomic_write_text",
           "build", "cache_dir", "cache_entries", "unwritable"]
