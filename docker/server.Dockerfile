# eagle3 extraction server on the official vLLM image (CUDA): `eagle3 serve --backend vllm`.
#
#   docker build -f docker/server.Dockerfile -t eagle3-server:0.1.0 .
#   docker run --gpus all --shm-size 64g -p 8000:8000 \
#     -v /srv/models/verifier:/models/verifier:ro -v "$PWD/api-keys.txt":/run/secrets/api_keys:ro \
#     eagle3-server:0.1.0
#
# The base tag is the vLLM version the vllm backend is tested with (pyproject's `vllm` extra); torch,
# vLLM and every other package the base image ships stay exactly as they are: eagle3 is installed with
# the base image's own versions as constraints, so pip only adds what is missing (zstandard, ...).
# The verifier is never baked in: mount a local Hugging Face checkpoint directory at /models/verifier
# (nothing is downloaded at run time: HF_HUB_OFFLINE=1).
FROM vllm/vllm-openai:v0.32.0

ENV HOME=/home/eagle3 \
    EAGLE3_CACHE_DIR=/home/eagle3/.cache/eagle3 \
    HF_HUB_OFFLINE=1 \
    VLLM_NO_USAGE_STATS=1 \
    DO_NOT_TRACK=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1

WORKDIR /opt/eagle3
COPY pyproject.toml README.md ./
COPY eagle3 eagle3
COPY core core
COPY client client
COPY server server
COPY draft_trainer draft_trainer

# PIP_BREAK_SYSTEM_PACKAGES: the base installs vLLM into the system Python, and so do we (an image, not a
# shared host). Non-root user; /data is where jobs write (a named volume mounted there inherits its owner).
RUN python3 -m pip list --format=freeze > /tmp/base-constraints.txt \
 && PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --no-cache-dir \
      --constraint /tmp/base-constraints.txt ".[vllm]" \
 && rm /tmp/base-constraints.txt \
 && python3 -c "import vllm, torch, eagle3, eagle3.server.app; print('vllm', vllm.__version__, 'torch', torch.__version__)" \
 && groupadd --gid 10001 eagle3 \
 && useradd --no-log-init --create-home --uid 10001 --gid 10001 --shell /usr/sbin/nologin eagle3 \
 && mkdir -p /data /models \
 && chown eagle3:eagle3 /data

USER 10001:10001
WORKDIR /home/eagle3
EXPOSE 8000

# Liveness only (the process answers); readiness with load progress is GET /readyz.
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
  CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/livez', timeout=4)"]

# The base image's entrypoint is `vllm serve`; ours is the eagle3 console script. Keys are required: a
# server bound to 0.0.0.0 without them would serve anyone (mount the file, or override the command).
ENTRYPOINT ["eagle3"]
CMD ["serve", "--backend", "vllm", "--model", "/models/verifier", "--host", "0.0.0.0", "--port", "8000", \
     "--api-keys-file", "/run/secrets/api_keys", "--drain-timeout-s", "300"]
