# syntax=docker/dockerfile:1
# plancache server: FastAPI + SQLAlchemy, no CUDA. Build from the repository root:
#   docker build -f docker/server.Dockerfile -t plancache-server:0.1.0 .
# Pinned: the base image by version, every Python package by docker/requirements-server.txt.
FROM python:3.11.14-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# An unprivileged user; /data holds the SQLite file when no PLANCACHE_DATABASE_URL is given.
RUN groupadd --system --gid 10001 plancache \
 && useradd --system --uid 10001 --gid plancache --home-dir /data --no-create-home --shell /usr/sbin/nologin plancache \
 && install -d -o plancache -g plancache -m 0750 /data

COPY docker/requirements-server.txt /tmp/requirements.txt
RUN pip install --no-cache-dir --no-deps -r /tmp/requirements.txt && rm /tmp/requirements.txt

# The source tree runs in place (PYTHONPATH): plancache finds its Alembic migrations next to the
# package, in /app/migrations, which a wheel install would not carry.
WORKDIR /app
COPY plancache ./plancache
COPY migrations ./migrations
COPY --chmod=0755 docker/plancache /usr/local/bin/plancache

ENV PYTHONPATH=/app \
    HOME=/data \
    PLANCACHE_DATABASE_URL=sqlite:////data/plancache.db \
    PLANCACHE_CACHE_DIR=/data/cache

USER 10001:10001
VOLUME ["/data"]
EXPOSE 8787

HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8787/healthz', timeout=2)"]

# `serve` applies the database migrations before it listens. Any other command:
#   docker run --rm plancache-server:0.1.0 db upgrade | token create --role worker --name gpu-1 | plans gc
ENTRYPOINT ["python", "-m", "plancache"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8787"]
