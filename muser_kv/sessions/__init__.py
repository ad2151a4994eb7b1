"""sessions: the session file format (header, digests, versions), save, load,
restore, the model fingerprint, safetensors with numpy, handoff between
processes, the CUDA upload helper. Imports caches and core."""
