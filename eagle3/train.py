"""``python -m eagle3.train ARGS`` = ``eagle3 train ARGS``: the entry point for ``torchrun``.

torchrun --nproc-per-node 2 -m eagle3.train --features F --vocab V --model M --out RUN
"""

from __future__ import annotations

import sys

from eagle3.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["train", *sys.argv[1:]]))
