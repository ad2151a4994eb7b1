"""The library's serving slots: ``SlotPool`` (slots, staging rebuild, atomic
swap, the batched step) and the chat shift its slots apply (``ChatShift``).
Called by applications through ``muser_kv``; ``muser-kv serve`` does not use it.
Imports the shared ``serving.policy`` and ``serving.install``, never
``serving.server``."""
