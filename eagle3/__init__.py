"""eagle3: train EAGLE-3 speculative-decoding drafts against a resident verifier.

Packages: ``client`` (SDK, CLI steps that run client-side: prepare; ``client.protocol`` is the
shared contract), ``server`` (the resident extraction server), ``draft_trainer`` (vocab, model,
training, export). This package holds only what spans them: the console script and model lookup.
"""

__version__ = "0.1.0"
