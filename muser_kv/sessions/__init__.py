"""sessions: the session file format (header, digests, versions) and the checks
of a file's tensors, save, load, the one restore path, the model fingerprint,
safetensors with numpy, handoff between processes and its wire, the CUDA upload
helper, the KV store (``store/``). Imports caches and core."""
