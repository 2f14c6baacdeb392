# The shard worker (and, with the same image, the code location and API): this package on vLLM's CUDA image.
#   docker build -f k8s/worker.Dockerfile -t registry.example/batch-pipeline-worker .
FROM vllm/vllm-openai:v0.32.0
WORKDIR /opt/batch_pipeline
COPY pyproject.toml README.md ./
COPY batch_pipeline ./batch_pipeline
RUN pip install --no-cache-dir . && python -c "import batch_pipeline.worker, vllm" \
 && useradd --uid 10001 --user-group --home-dir /home/worker --create-home --shell /usr/sbin/nologin worker
# Every process runs as `worker`, and finds its caches (models, vLLM, torch) under this home, which the pods
# mount as an emptyDir over a read-only root. The one exception, a tool_config job's worker, runs as uid 0
# (batch_pipeline/launch/k8s.py) with HOME still here, so that its sandbox can give model code uids of its own.
ENV HOME=/home/worker
USER 10001:10001
ENTRYPOINT []
CMD ["python", "-m", "batch_pipeline.worker"]
