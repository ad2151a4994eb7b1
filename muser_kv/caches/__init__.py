"""caches: one class per storage regime (sliding ring, growing plane, batch),
the cache list as one unit, the speculative checkpoint, and the factory
(``make_prompt_cache``). Imports core only."""
