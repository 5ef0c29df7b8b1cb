"""CRC-32 of frames (``core/protocol/frames.py``) at memory speed.

The frame format fixes zlib's CRC-32 (polynomial 0xEDB88320, ``zlib.crc32``'s results); the standard
library's implementation runs at about 1.1-1.4 GB/s on one core here, which on a 2-core host serving
650 MB of states took about a second of the client's and of the server's CPU each. zlib-ng's
(``zlib-ng`` on PyPI, a maintained drop-in for ``zlib``; carry-less multiply where the CPU has it)
returns the same values at about 3.5-4 GB/s and releases the GIL on large buffers, like zlib's.
``core/protocol`` stays standard-library only: its encoder and decoder take the function as
``crc32=``, so the SDK and the server pass this one and a bare protocol user keeps ``zlib.crc32``.
"""

from __future__ import annotations

from zlib_ng.zlib_ng import crc32

__all__ = ["crc32"]  # crc32(data, value=0) -> int: zlib.crc32's signature and results
