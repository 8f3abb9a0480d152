# kvidx: one image for the relay, the stream worker and the lookup service.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY kvidx kvidx
COPY schemas schemas
COPY relays relays
COPY streams streams
COPY index_service index_service
RUN pip install --no-cache-dir .
ENTRYPOINT ["kvidx"]
CMD ["--help"]
