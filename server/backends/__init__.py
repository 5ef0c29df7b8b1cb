"""Engine backends behind one contract: ``hf`` (transformers) and ``vllm`` (production, TP=8)."""
