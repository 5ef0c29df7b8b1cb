"""The light eagle3 SDK (no torch): dataset preparation now; the extraction client next.

Python API of the CLI steps: ``prepare_dataset(inputs, out_dir, model=..., config=PrepareConfig())``.
"""

from client.prepare import PrepareConfig, PrepareError, prepare_dataset

__all__ = ["PrepareConfig", "PrepareError", "prepare_dataset"]
