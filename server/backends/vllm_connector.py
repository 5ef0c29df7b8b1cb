"""The KV connector that hands vLLM's extracted hidden states to the vllm backend.

vLLM's ``extract_hidden_states`` speculative method stores, per token, the residual stream at the
requested layers in a cache-only attention layer; a KV connector takes them out when a request
finishes. The stock ``ExampleHiddenStatesConnector`` (vLLM 0.32) copies them device-to-host into
pinned memory on a CUDA stream, which raises on CPU-only torch (``pin_memory=True requires a CUDA or
other accelerator backend``). ``Eagle3HiddenStatesConnector`` keeps the stock connector's scheduler
side, file naming and flock protocol (``load_hidden_states`` blocks until the write is done) and
changes the worker-side gather only where it must:

* CUDA: the stock asynchronous path, unchanged.
* CPU: the cache already lives in host memory, so the gather is a synchronous fancy-index copy; the
  write goes to the same writer thread pool with an event that is already complete.

Why files and not memory: vLLM's connector API has no channel that carries tensors from the worker
to the caller. The worker can report only request ids (``KVConnectorOutput``), and the scheduler
fixes ``kv_transfer_params`` in ``request_finished`` before the worker has gathered anything; the
caller, the engine core and the worker are three processes (CPU always runs the multiprocess
executor; TP>1 does everywhere). So the backend points ``shared_storage_path`` at a private tmpfs
directory (``/dev/shm``): the handover is one memcpy into shared memory and one out, never disk.

Loaded by vLLM's engine and worker processes through ``kv_connector_module_path``
(``eagle3.server.backends.vllm_connector``): this module must stay importable there, so it imports only
vLLM and torch.
"""

from __future__ import annotations

import fcntl
import os
from functools import partial
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)

from eagle3.server.backends import engine_guard

engine_guard.arm()  # in vLLM's engine/worker processes: die with the server (a no-op in the server)

CONNECTOR_NAME = "Eagle3HiddenStatesConnector"
CONNECTOR_MODULE = "eagle3.server.backends.vllm_connector"


class _CompletedCopy:
    """Stands in for ``torch.cuda.Event`` when the copy finished before it was created."""

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


class Eagle3HiddenStatesConnector(ExampleHiddenStatesConnector):
    """``ExampleHiddenStatesConnector`` that also runs on CPU (see the module docstring).

    Invariant: the file for request ``r`` holds ``hidden_states [n_tokens, n_layers, hidden]`` and
    ``token_ids [n_tokens]`` (the prompt), and its ``.lock`` is held exclusively until the write is
    complete; only TP rank 0 writes.
    """

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        kv_cache: Any = self._kv_cache
        assert kv_cache is not None
        if kv_cache.device.type != "cpu":
            super()._submit_async_write(pending)
            return
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)  # [n_blocks]
        offsets = torch.arange(self._block_size, dtype=torch.long)  # [block_size]
        slot_mapping = (block_ids[:, None] * self._block_size + offsets[None, :]).flatten()  # [n_blocks*block]
        n_tokens = int(pending.token_ids.shape[0])
        # fancy indexing copies: the cache blocks may be reused as soon as this returns
        states = extract_from_kv_cache(kv_cache, slot_mapping, n_tokens).contiguous()  # [T, L, H]
        tensors = {"hidden_states": states, "token_ids": pending.token_ids.clone()}
        assert self._req_futures.get(pending.req_id) is None, f"duplicate request id {pending.req_id}"
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        done: Any = _CompletedCopy()  # a torch.cuda.Event look-alike
        future = self._executor.submit(self._write_tensors, tensors, done, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
