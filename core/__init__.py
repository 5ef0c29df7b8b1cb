"""The core every other eagle3 package stands on; it imports nothing of ours outside itself.

* ``protocol/``: the wire and file contracts, stdlib only: frames (byte table, sans-IO decoder),
  typed wire meta (``wire.py``), the prepared and features formats.
* ``codec``: payload codecs (numpy, zstandard) and the safetensors blob both sides build and parse.
* ``features_writer`` / ``features_reader`` / ``sample``: the features directory, written by the
  SDK and read by the trainer.
* ``conversations`` / ``masking``: chat rows and the render-boundary loss mask (prepare and the
  server's ``messages`` requests share them).
* ``models``: ``--model`` lookup (the embedded verifier, local directories), checkpoint and
  tokenizer identity; ``layers``: which layers are tapped and how a layer id maps to a module.
* ``cli_args``: argument types the console commands share; ``errors``: the error tree's base.

Nothing here imports torch at import time.
"""
