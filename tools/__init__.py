"""Developer tooling: build support, code generators. Not installed with the package."""
