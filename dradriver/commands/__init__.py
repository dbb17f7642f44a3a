"""One module per ``dradriver`` subcommand.

Each module defines ``register(subparsers)`` (adds its parser and sets ``func=run``) and
``run(args) -> int``. Modules import heavy dependencies inside ``run`` so ``dradriver --help`` stays fast.

Importing this package gives gRPC its start-up settings (:mod:`dradriver.commands._grpcenv`), before any entry
point imports ``grpc``.
"""

from dradriver.commands import _grpcenv

_grpcenv.apply_defaults()
