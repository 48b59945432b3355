"""One module per ``fp4pass`` subcommand: ``register(subparsers, common)`` adds its parser (with examples in
the epilog) and sets ``run(args) -> exit code``. A command only parses, calls one library function, and prints.
"""
