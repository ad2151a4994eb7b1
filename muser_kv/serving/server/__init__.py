"""``muser-kv serve``: mlx-lm's HTTP server with muser-kv's caches (``serve``),
its flags, its exact prompt cache (``ExactPromptCache``), its KV admission
(``KVBudget``), its request checks and context fit, and the one module that
names every mlx-lm internal it relies on (``mlx_lm_server``). Imports the
shared ``serving.policy``, ``serving.install`` and ``serving.checkpoints``,
never ``serving.pool``."""
