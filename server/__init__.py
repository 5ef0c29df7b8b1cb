"""The resident extraction server (``eagle3 serve``): loads the verifier once and serves
``/v1/extract`` to every user.

``app`` (FastAPI routes, auth, errors) -> ``runtime`` (owns the backend, scheduler, encoder pool and
metrics) -> ``scheduler`` (token-budgeted packing across tenants) -> ``backends`` (``hf``, ``vllm``,
one contract in ``backends/base.py``); ``stream`` encodes results as frames. It stands on
``eagle3.core`` only; only ``backends/vllm*.py`` import vllm (docs/architecture.md).
"""
