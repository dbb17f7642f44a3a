"""dradriver's benchmark suite (pytest-benchmark); run it with ``python -m bench``."""
