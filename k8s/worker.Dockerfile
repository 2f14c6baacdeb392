# The shard worker (and, with the same image, the code location and API): this package on vLLM's CUDA image.
#   docker build -f k8s/worker.Dockerfile -t registry.example/batch-pipeline-worker .
FROM vllm/vllm-openai:v0.32.0
WORKDIR /opt/batch_pipeline
COPY pyproject.toml README.md ./
COPY batch_pipeline ./batch_pipeline
RUN pip install --no-cache-dir . && python -c "import batch_pipeline.worker, vllm"
ENTRYPOINT []
CMD ["python", "-m", "batch_pipeline.worker"]
