"""The language front end: grammar, syntax tree, parser, checker, loader (the only place Lark is used)."""
