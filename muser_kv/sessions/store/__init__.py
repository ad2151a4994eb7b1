"""The KV store: chunks of a prefix's K/V rows keyed by a prefix hash chain,
held in memory and in byte tiers (``tiers``: a local directory, Redis)."""
