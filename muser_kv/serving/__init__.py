"""serving: the shared context policy, the library's slot pool (``pool/``),
``muser-kv serve`` (``server/``), mlx-lm's integration (install, the
generate / chat / cache-prompt commands) and the CLI. Imports any layer below."""
