"""serving: context policy and serving slots, the server's exact prompt cache,
mlx-lm's integration (install, commands, serve, prompt-cache files), the CLI
and selftest. Imports any layer below."""
