"""One module per ``dradriver`` subcommand.

Each module defines ``register(subparsers)`` (adds its parser and sets ``func=run``) and
``run(args) -> int``. Modules import heavy dependencies inside ``run`` so ``dradriver --help`` stays fast.
"""
