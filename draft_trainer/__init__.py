"""The EAGLE-3 draft trainer: vocabulary, draft model, training on features directories, export in
vLLM's format, and evaluation by real speculative decoding. It stands on ``eagle3.core`` only (the
features directory is its one channel from the server) and never loads the whole verifier for
training: only its embedding, final norm and lm_head (docs/training.md)."""
