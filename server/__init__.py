"""The resident extraction server: loads the verifier once, serves ``/v1/extract`` to every user.

Not built yet (a later issue): FastAPI app, token-budgeted scheduling across tenants, and the
``hf`` and ``vllm`` backends in ``server/backends/``. It may import ``eagle3.core.protocol``; only
``server/backends/vllm.py`` may import vllm.
"""
